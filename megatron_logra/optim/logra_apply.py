"""Writing a prepared LoGRA update into the weights: ``W ← decay·W − α·D·A``, checked before anything is written.

:meth:`LograApplyMixin.apply` is the only place the targets' weights and masters change during training
(besides :meth:`~LograApplyMixin.reanchor`). It refuses, on every model-parallel rank alike, a step that is
not finite anywhere, and with sketch-delta factors it runs the inference engine's own merge, so trainer and
engine weights stay bitwise equal (:mod:`megatron_logra.sync.apply`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_logra.optim.functional import apply_low_rank_update_
from megatron_logra.optim.native import reduce_flag_any
from megatron_logra.optim.update import PreparedUpdate
from megatron_logra.sync.apply import StochasticRounding, low_rank_merge_, shard_rows

__all__ = ["LograApplyMixin"]


class LograApplyMixin:
    """``apply`` and its checks for :class:`~megatron_logra.optim.logra.LograOptimizer`; needs ``cfg``,
    ``groups``, ``device``, ``targets``, ``sketches``, ``native``, ``masters``, ``num_steps``,
    ``weight_decay_factor`` and ``zero_grad`` on the optimizer."""

    def _check_factors(self, factors: dict[str, torch.Tensor]) -> None:
        missing = sorted(t.key for t in self.targets if t.key not in factors)
        unknown = sorted(set(factors) - {t.key for t in self.targets})
        if missing or unknown:
            raise ValueError(f"factors do not match the targets: missing {missing[:4]}, unknown {unknown[:4]}")
        for t in self.targets:
            U = factors[t.key]
            if U.dtype != torch.bfloat16 or tuple(U.shape) != (t.n_out_local, self.cfg.rank):
                raise ValueError(f"factor of {t.key} is {U.dtype} {tuple(U.shape)}, expected bf16 "
                                 f"{(t.n_out_local, self.cfg.rank)}")

    def _check_finite_step(self, steps: dict[str, torch.Tensor], alpha: float, decay: float) -> None:
        """Raise ``ValueError`` on every model-parallel rank when on any rank some ``alpha·steps[key]``
        or the decay factor is not finite (no scaled copy is made: ``|α|·max|D|`` tells NaN, inf and overflow)."""
        missing = [t.key for t in self.targets if t.key not in steps]
        if missing:
            raise ValueError(f"the update has no direction for targets {missing[:4]}")
        bad = []
        for t in self.targets:
            x = steps[t.key]
            # NaN fails the comparison; so does α·D overflowing D's dtype
            if x.numel() and not (abs(alpha) * float(x.abs().max()) <= torch.finfo(x.dtype).max):
                bad.append(t.key)
        if reduce_flag_any(bool(bad) or not math.isfinite(decay), self.groups.mp, self.device):
            where = (f"targets {bad[:4]}{'...' if len(bad) > 4 else ''}" if bad else
                     f"the weight decay factor {decay}" if not math.isfinite(decay) else "another model-parallel rank")
            raise ValueError(f"step {self.num_steps + 1}: the update is not finite ({where}); refusing to write it "
                             "into the weights (nothing was modified)")

    def merge_rounding(self) -> str:
        """How the sketch-delta merge rounds bf16 weights, on this trainer and (through the delta's header)
        on the engines: ``logra.rounding``, except ``nearest`` where a target is one HF-split piece of a
        fused layer (``q_proj`` ...: its canonical rows need the attention layout, which is not kept here)."""
        if self.cfg.rounding != "stochastic" or any(t.key != t.name for t in self.targets):
            return "nearest"
        return "stochastic"

    def _merge_noise(self, t, step: int):
        """Where target ``t``'s merge noise comes from: its canonical rows and first input column on this rank."""
        rows = None
        if t.parallel == "column":
            rows = shard_rows(t.n_out_local, self.groups.tp_rank, self.groups.tp_size,
                              int(getattr(t.weight, "partition_stride", 1)))
        col_start = t.cols.start if t.cols is not None else 0
        return StochasticRounding(self.cfg.seed, t.name, step, rows, col_start)

    @torch.no_grad()
    def apply(self, update: PreparedUpdate, alpha: float = 1.0, *,
              factors: Optional[dict[str, torch.Tensor]] = None) -> None:
        """``W ← decay·W − α·D·A`` for every target, native AdamW step, advance the projection.

        The decoupled weight decay ``decay = 1 − lr_t·wd`` (optimizer recipe; ``lr_t`` the scheduled lr of this
        step, ``lr·update.lr_multiplier`` except at the floor, where it is ``schedule.min_lr`` itself) does not scale with α: α scales the gradient
        step only, as a step-size controller expects.

        ``factors`` (opt-in, sketch-delta sync): target key -> this rank's bf16
        ``U = quantize_factor(α·D)`` ``[n_out_local, r]`` (:func:`megatron_logra.sync.trainer.local_factors`).
        The low-rank step is then :func:`megatron_logra.sync.apply.low_rank_merge_` with exactly
        those factors -- the arithmetic the inference engine runs -- so trainer and engine weights
        stay bitwise equal. A bf16 weight is rounded as :meth:`merge_rounding` says (stochastically by
        default, with the noise the engine draws for the same canonical entry; see
        :mod:`megatron_logra.sync.apply`). With fp32 masters the master takes the fp32 step ``α·D·A``
        (not ``U``, whose bf16 rounding costs ~2⁻⁹ of each step) and the compute weight runs the
        engine's own merge, so it still mirrors the engine bitwise; the two
        drift apart by rounding (:meth:`master_drift`) until :meth:`reanchor` copies the masters back
        (followed by a full engine refit). All factors are checked first.

        Nothing is written unless everything the step writes is finite: α, the weight decay factor
        and every target's ``α·D`` (or factor) on every model-parallel rank (agreed with one
        collective, as :meth:`prepare` agrees on skips); otherwise every rank raises ``ValueError``
        with weights, masters, native state and the projection index untouched. (The native
        gradients were checked by :meth:`prepare`.)
        """
        if update.skipped:
            return
        if not math.isfinite(alpha):
            raise ValueError(f"step size alpha={alpha} is not finite; refusing an uncontrolled step")
        assert update.update_index == self.sketches.update, "update prepared with another projection index"
        cfg = self.cfg
        decay = self.weight_decay_factor(update)
        tp_rank = self.groups.tp_rank
        if factors is not None:
            self._check_factors(factors)
            stochastic = self.merge_rounding() == "stochastic"
        self._check_finite_step(factors if factors is not None else update.directions,
                                1.0 if factors is not None else alpha, decay)
        for t in self.targets:
            proj_RI = self.sketches.projection_for(t, update.update_index)
            if factors is not None:
                master = self.masters.get(t.key)
                if master is not None:  # the exact fp32 step α·D·A (not the bf16 U), kept beside the engine mirror
                    apply_low_rank_update_(master, update.directions[t.key] * alpha, proj_RI, decay=decay)
                low_rank_merge_(t.weight, factors[t.key], proj_RI, decay=decay, distribution=cfg.distribution,
                                rounding=self._merge_noise(t, update.step) if stochastic else None)
                continue
            factor = update.directions[t.key] if alpha == 1.0 else update.directions[t.key] * alpha
            if t.key in self.masters or t.weight.dtype == torch.float32:  # one GEMM into fp32
                apply_low_rank_update_(t.weight, factor, proj_RI, decay=decay, master=self.masters.get(t.key))
                continue
            # bf16/fp16 compute weights without masters: the merge kernel (large row chunks on
            # accelerators, int32 noise into preallocated buffers) with the noise the sketch-delta merge
            # uses, so this path rounds as the synced one does
            noise = None
            if t.weight.dtype == torch.bfloat16 and cfg.rounding == "stochastic":
                noise = (self._merge_noise(t, update.step) if self.merge_rounding() == "stochastic" else
                         StochasticRounding(cfg.seed, f"{t.key}|tp{tp_rank}", update.step))
            low_rank_merge_(t.weight, factor, proj_RI, decay=decay, distribution=cfg.distribution, rounding=noise)
        self.native.step(scale=alpha if self.cfg.scale_native else 1.0)
        self.num_steps += 1
        self.sketches.advance()
        self.zero_grad()

    @torch.no_grad()
    def reanchor(self) -> None:
        """Copy the fp32 masters (rounded to nearest) into the compute weights."""
        for t in self.targets:
            master = self.masters.get(t.key)
            if master is not None:
                t.weight.copy_(master)

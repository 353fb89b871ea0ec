"""The LoGRA optimizer: sketches of the targets + a native AdamW for everything else.

A step is split in two so a step-size controller can sit between them::

    opt.zero_grad()
    ... forward / backward (sketches and native grads accumulate) ...
    update = opt.prepare(num_tokens=...)   # reduce, check, clip/normalise, RowAdam -> directions D
    alpha = controller(update)             # e.g. predicted-KL step control (paper recipe)
    opt.apply(update, alpha)               # W ← decay·W − α·D·A, native AdamW, next projection

``opt.step()`` is ``apply(prepare(), 1.0)``. A non-finite sketch or native gradient on any
rank skips the step on every rank: weights, row moments and the projection index are
untouched and the update says why.

A learning-rate schedule (``schedule``, :mod:`megatron_logra.optim.schedule`) multiplies, for the
step being prepared, the optimizer recipe's ``lr`` (folded into ``D``: what the KL probe, the
sketch-delta factors and ``apply`` all use) and its weight-decay factor, and the native AdamW's lr;
the paper recipe's targets have no lr, so it reaches the native AdamW only there.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.optim.config import LograConfig, NativeConfig
from megatron_logra.optim.functional import (
    apply_low_rank_update_,
    reconstructed_norm2,
    row_adam_direction,
)
from megatron_logra.optim.logra_state import LograStateMixin
from megatron_logra.optim.native import NativeAdamW, reduce_flag_any
from megatron_logra.optim.schedule import LRScheduleConfig, lr_multiplier, scheduled_lr
from megatron_logra.optim.update import PreparedUpdate, module_params
from megatron_logra.parallel import ParallelGroups, all_reduce_sum, group_size
from megatron_logra.sketch.capture import SketchSet, SketchTarget, install_sketches
from megatron_logra.sync.apply import StochasticRounding, low_rank_merge_, shard_rows

logger = logging.getLogger(__name__)

__all__ = ["LograOptimizer"]


def _check_rounding(cfg: LograConfig, targets: Sequence[SketchTarget]) -> None:
    """Stochastic rounding of master-less updates exists for bf16 weights only: fp16 targets with
    ``masters=none`` and ``rounding=stochastic`` would silently round to nearest and lose every update
    below half an fp16 ulp, so they are refused (``ValueError`` naming the fields and the fix)."""
    if cfg.masters != "none" or cfg.rounding != "stochastic":
        return
    fp16 = [t.module_name for t in targets if t.weight.dtype == torch.float16]
    if fp16:
        raise ValueError(
            f"optimizer.logra.masters=none with optimizer.logra.rounding=stochastic needs bf16 target weights, "
            f"but {len(fp16)} target(s) are float16 (e.g. {fp16[0]}): stochastic rounding exists for bf16 only, "
            f"and rounding fp16 updates to nearest loses every one below half an fp16 ulp; set "
            f"optimizer.logra.masters=fp32 (fp32 master copies), train in bf16 (model.params_dtype=bfloat16), "
            f"or accept the loss with optimizer.logra.rounding=nearest")


class LograOptimizer(LograStateMixin):
    """LoGRA on the targets of ``model``; AdamW (or frozen) for the rest."""

    def __init__(
        self,
        model: Union[nn.Module, Sequence[nn.Module]],
        cfg: LograConfig,
        native: NativeConfig,
        groups: ParallelGroups,
        *,
        schedule: Optional[LRScheduleConfig] = None,
        total_steps: Optional[int] = None,
    ) -> None:
        """``schedule`` (None: constant lrs) with ``total_steps``, the job's optimizer steps that a schedule
        without ``decay_steps`` decays over (``ValueError`` when it needs them and they are missing)."""
        if schedule is not None and (total_steps is None or total_steps > 0):  # (a job of 0 steps takes none)
            schedule.resolve_decay_steps(total_steps)  # refuse a schedule that cannot be evaluated, before building
        self.cfg = cfg
        self.groups = groups
        self.schedule = schedule
        self.total_steps = total_steps
        self.sketches: SketchSet = install_sketches(
            model, cfg.targets, cfg.rank, cfg.seed, cfg.distribution, cfg.refresh,
            tp_group=groups.tp, pp_group=groups.pp, cache_projections=cfg.cache_projections,
        )
        try:
            _check_rounding(cfg, self.sketches.targets)
        except ValueError:
            self.sketches.remove()
            raise
        self.device = self.sketches.flat.device
        others = [p for p in module_params(model) if p.requires_grad]
        if native.freeze:
            for p in others:
                p.requires_grad_(False)
            others = []
        self.native = NativeAdamW(
            others, lr=native.lr, betas=(native.beta1, native.beta2), eps=native.eps,
            weight_decay=native.weight_decay, groups=groups,
        )
        self.row_moments: dict[str, torch.Tensor] = {
            t.key: torch.zeros(t.n_out_local, dtype=torch.float32, device=self.device) for t in self.targets
        }
        self.masters: dict[str, torch.Tensor] = {}
        if cfg.masters == "fp32":
            for t in self.targets:
                if t.weight.dtype != torch.float32:
                    self.masters[t.key] = t.weight.detach().float().clone()
        self.num_steps = 0
        self.num_skipped = 0

    @property
    def targets(self) -> list[SketchTarget]:
        return self.sketches.targets

    # ------------------------------------------------------------------ bookkeeping
    def zero_grad(self) -> None:
        self.sketches.zero_()
        self.native.zero_grad()

    def persistent_bytes(self) -> dict[str, int]:
        """Bytes of optimizer-owned persistent state by kind (weights excluded)."""
        return {
            "sketches": self.sketches.flat.numel() * 4,
            "row_moments": sum(v.numel() * 4 for v in self.row_moments.values()),
            "masters": sum(m.numel() * 4 for m in self.masters.values()),
            # fp32 params: grad 4 + moments 8; low-precision: fp32 main grad 4 + master 4 + moments 8
            "native": sum(
                p.numel() * ((4 if p.dtype == torch.float32 else 4 + 4) + 8) for p in self.native.params
            ),
        }

    def _replicated_on_tp(self, t: SketchTarget) -> bool:
        return t.parallel == "none"

    def _tp_sum_layers(self, values: torch.Tensor, replicated: list[bool]) -> torch.Tensor:
        """Sum per-layer partial statistics over TP; rows flagged replicated are already full."""
        tp = group_size(self.groups.tp)
        if tp == 1:
            return values
        mask = torch.tensor(replicated, device=values.device)
        values = torch.where(mask[:, None], values / tp, values)
        return all_reduce_sum(values, self.groups.tp)

    def _mp_sum(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values, self.groups.mp)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def prepare(self, num_tokens: Optional[int] = None) -> PreparedUpdate:
        """Reduce sketches and grads, check them, and compute the scaled directions.

        ``num_tokens``: this rank's valid tokens when the loss was a *sum* over tokens; the
        sketches and grads are then summed over data parallel ranks and divided by the global
        count (required by the paper recipe). Without it they are averaged over DP ranks.
        """
        cfg, ss = self.cfg, self.sketches
        paper = cfg.recipe == "paper"
        update = PreparedUpdate(step=self.num_steps + 1, update_index=ss.update)
        by_tokens = num_tokens is not None
        if paper and not by_tokens:
            raise ValueError("logra.recipe=paper normalises by tokens: pass num_tokens to prepare()")
        ss.reduce_tensor_parallel()
        dp = group_size(self.groups.dp)
        if dp > 1:
            dist.all_reduce(ss.flat, group=self.groups.dp)
        self.native.reduce_gradients(average=not by_tokens)
        if by_tokens:
            total = torch.tensor([float(num_tokens)], dtype=torch.float64, device=self.device)
            all_reduce_sum(total, self.groups.dp)
            if total.item() <= 0:
                raise ValueError("no valid tokens in this step (num_tokens summed over data parallel ranks is 0)")
            update.num_tokens = int(total.item())
            ss.flat.div_(total.item())
            self.native.scale_grads_(1.0 / total.item())
        elif dp > 1:
            ss.flat.div_(dp)

        bad = not (bool(torch.isfinite(ss.flat).all()) and self.native.all_finite())
        if reduce_flag_any(bad, self.groups.mp, self.device):
            self.num_skipped += 1
            update.skipped, update.reason = True, "non-finite sketch or gradient"
            if self.groups.is_rank0:  # every rank skips together (the flag is reduced above)
                logger.warning("step %d skipped: non-finite sketch or gradient (%d skipped so far)", update.step,
                               self.num_skipped)
            self.zero_grad()
            return update

        update.lr_multiplier = self._lr_multiplier(update.step)
        if self.schedule is not None:  # before native_deltas() reads it and apply() steps with it
            self.native.set_lr(self._scheduled(self.native.base_lr, update.step))
        projs = {t.key: ss.projection_for(t) for t in self.targets}
        tp_rank = self.groups.tp_rank
        norm2 = torch.zeros((), dtype=torch.float64, device=self.device)
        for t in self.targets:
            if not self._replicated_on_tp(t) or tp_rank == 0:
                norm2 += reconstructed_norm2(t.sketch, projs[t.key])
        norm2 = norm2 + self.native.local_norm2(self.device)
        update.grad_norm = math.sqrt(self._mp_sum(norm2.reshape(1)).item())

        if not paper and cfg.clip_grad > 0 and update.grad_norm > cfg.clip_grad:
            update.clip_coef = cfg.clip_grad / (update.grad_norm + 1e-6)
            ss.flat.mul_(update.clip_coef)
            self.native.scale_grads_(update.clip_coef)

        for t in self.targets:
            if cfg.algorithm == "row_adam":
                d = row_adam_direction(t.sketch, self.row_moments[t.key], update.step, cfg.beta2, cfg.eps)
            else:
                d = t.sketch.clone()
            update.directions[t.key] = d

        if paper:
            self._paper_scale(update, projs)
        else:
            lr = self._scheduled(cfg.lr, update.step)  # the scheduled lr (cfg.lr itself at multiplier 1.0)
            update.scale = lr
            for d in update.directions.values():
                d.mul_(lr)
        return update

    def _lr_multiplier(self, step: int) -> float:
        """The schedule's factor for 1-based ``step`` (1.0 without a schedule)."""
        if self.schedule is None:
            return 1.0
        return lr_multiplier(step, self.schedule, self.total_steps, self._reference_lr())

    def _reference_lr(self) -> float:
        """The lr ``--lr`` sets, which an absolute ``optimizer.schedule.min_lr`` is the floor of: the targets' for
        the optimizer recipe, else the non-target AdamW's (``OptimizerConfig.scheduled_lrs``)."""
        return self.cfg.lr if self.cfg.recipe == "optimizer" else self.native.base_lr

    def _scheduled(self, peak: float, step: int) -> float:
        """The configured lr ``peak`` after the schedule at 1-based ``step`` (``peak`` without a schedule): at
        the floor of the decay exactly the floor lr (:func:`~megatron_logra.optim.schedule.scheduled_lr`)."""
        if self.schedule is None:
            return peak
        return scheduled_lr(peak, step, self.schedule, self.total_steps, self._reference_lr())

    def step_lrs(self, update: PreparedUpdate) -> dict[str, Optional[float]]:
        """The learning rates ``update`` is (or was) applied with, after the schedule, for a step's metrics
        record: ``lr``, the native AdamW's (None when the non-targets are frozen), and ``logra_lr``, the
        targets' (optimizer recipe; None for the paper recipe, whose step follows the KL controller). Both
        None for a skipped update."""
        if update.skipped:
            return {"lr": None, "logra_lr": None}
        native = self._scheduled(self.native.base_lr, update.step) if self.native.params else None
        logra = self._scheduled(self.cfg.lr, update.step) if self.cfg.recipe == "optimizer" else None
        return {"lr": native, "logra_lr": logra}

    def _paper_scale(self, update: PreparedUpdate, projs: dict[str, torch.Tensor]) -> None:
        """Per-layer ‖D‖_F = ‖S‖_F, then one global scale so ‖ΔW‖/‖W‖ = update_ratio over all targets."""
        targets = self.targets
        stats = torch.zeros(len(targets), 2, dtype=torch.float64, device=self.device)
        for i, t in enumerate(targets):
            stats[i, 0] = t.sketch.double().pow(2).sum()
            stats[i, 1] = update.directions[t.key].double().pow(2).sum()
        # column-parallel rows are split over TP; row-parallel and plain sketches are full rows
        stats = self._tp_sum_layers(stats, [t.parallel != "column" for t in targets])
        for i, t in enumerate(targets):
            s2, d2 = stats[i, 0].item(), stats[i, 1].item()
            if d2 > 0:
                update.directions[t.key].mul_(math.sqrt(s2 / d2))
        tp_rank = self.groups.tp_rank
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for t in targets:
            if self._replicated_on_tp(t) and tp_rank != 0:
                continue
            totals[0] += reconstructed_norm2(update.directions[t.key], projs[t.key])
            totals[1] += t.weight.double().pow(2).sum() if t.key not in self.masters else self.masters[t.key].double().pow(2).sum()
        totals = self._mp_sum(totals)
        delta_norm, weight_norm = math.sqrt(totals[0].item()), math.sqrt(totals[1].item())
        scale = self.cfg.update_ratio * weight_norm / delta_norm if delta_norm > 0 else 0.0
        update.scale = scale
        for d in update.directions.values():
            d.mul_(scale)

    @torch.no_grad()
    def native_deltas(self, update: PreparedUpdate) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The native AdamW's part of ``update`` at α = 1: ``(parameter, fp32 change)`` for every trained
        non-target parameter (:meth:`NativeAdamW.planned_deltas`); :meth:`apply` with step size α changes
        each by α times its change (``logra.scale_native``). Empty when non-target parameters are frozen
        (no work, no memory) or the update is skipped. A predicted-KL probe needs these beside the
        target directions to predict the whole step.

        Raises ``ValueError`` with ``logra.scale_native=false``: the native step then does not scale
        with α, and no prediction quadratic in α covers it.
        """
        if update.skipped or not self.native.params:
            return []
        if not self.cfg.scale_native:
            raise ValueError("optimizer.logra.scale_native=false applies the native AdamW step in full whatever the "
                             "step size α: a KL prediction quadratic in α cannot cover it; set "
                             "optimizer.logra.scale_native=true or optimizer.native.freeze=true")
        return self.native.planned_deltas()

    @torch.no_grad()
    def relative_update_norm(self, update: PreparedUpdate, alpha: float = 1.0) -> float:
        """``‖ΔW‖_F / ‖W‖_F`` over all targets for step size ``alpha`` (through the r×r Gram)."""
        if update.skipped:
            return 0.0
        tp_rank = self.groups.tp_rank
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for t in self.targets:
            if self._replicated_on_tp(t) and tp_rank != 0:
                continue
            proj_RI = self.sketches.projection_for(t, update.update_index)
            totals[0] += reconstructed_norm2(update.directions[t.key], proj_RI)
            weight = self.masters.get(t.key, t.weight)
            totals[1] += weight.double().pow(2).sum()
        totals = self._mp_sum(totals)
        return abs(alpha) * math.sqrt(totals[0].item() / max(totals[1].item(), 1e-300))

    @torch.no_grad()
    def native_relative_update_norm(self, native: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> float:
        """``‖Δθ‖_F / ‖θ‖_F`` of the trained non-targets' α = 1 change ``native`` (:meth:`native_deltas`),
        summed over the model-parallel group so every rank of it gets the same figure (collective: every
        rank of the group calls, with or without parameters of its own); 0 when nothing is trained."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for param, delta in native:
            totals[0] += delta.double().pow(2).sum()
            totals[1] += param.double().pow(2).sum()
        totals = self._mp_sum(totals)
        return math.sqrt(totals[0].item() / totals[1].item()) if totals[1].item() > 0 else 0.0

    @torch.no_grad()
    def master_drift(self) -> float:
        """``‖W − round(master)‖ / ‖round(master)‖`` over all targets with fp32 masters (0 without).

        Under sketch-delta sync the compute weights replay the engine's low-precision merges
        while the masters accumulate in fp32; this is how far the two have separated.
        """
        if not self.masters:
            return 0.0
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for t in self.targets:
            master = self.masters.get(t.key)
            if master is None:
                continue
            rounded = master.to(t.weight.dtype)
            totals[0] += (t.weight.double() - rounded.double()).pow(2).sum()
            totals[1] += rounded.double().pow(2).sum()
        totals = self._mp_sum(totals)
        return math.sqrt(totals[0].item() / max(totals[1].item(), 1e-300))

    @torch.no_grad()
    def reanchor(self) -> None:
        """Copy the fp32 masters (rounded to nearest) into the compute weights."""
        for t in self.targets:
            master = self.masters.get(t.key)
            if master is not None:
                t.weight.copy_(master)

    def weight_decay_factor(self, update: Optional[PreparedUpdate] = None) -> float:
        """``decay`` of ``W ← decay·W − ΔW`` for ``update`` (None: the next step to be prepared):
        ``1 − lr_t·wd`` with ``lr_t`` the scheduled lr of its step (``lr·m``, the schedule's multiplier ``m``; exactly
        ``schedule.min_lr`` at the floor: ``scheduled_lr``) for the optimizer recipe, or 1 (paper recipe)."""
        cfg = self.cfg
        if cfg.recipe != "optimizer":
            return 1.0
        step = update.step if update is not None else self.num_steps + 1
        return 1.0 - self._scheduled(cfg.lr, step) * cfg.weight_decay

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

    def step(self, num_tokens: Optional[int] = None) -> PreparedUpdate:
        """``prepare`` then ``apply`` with α = 1."""
        update = self.prepare(num_tokens)
        self.apply(update, 1.0)
        return update

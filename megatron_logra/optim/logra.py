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
from megatron_logra.optim.functional import reconstructed_norm2, row_adam_direction
from megatron_logra.optim.logra_apply import LograApplyMixin
from megatron_logra.optim.logra_lr import LograScheduleMixin
from megatron_logra.optim.logra_norms import LograNormsMixin
from megatron_logra.optim.logra_state import LograStateMixin
from megatron_logra.optim.loss_scale import LossScaleConfig, account_step, build_loss_scaler, skip_reason
from megatron_logra.optim.native import NativeAdamW, reduce_flag_any
from megatron_logra.optim.schedule import LRScheduleConfig
from megatron_logra.optim.update import PreparedUpdate, module_params
from megatron_logra.parallel import ParallelGroups, all_reduce_sum, group_size
from megatron_logra.sketch.capture import install_sketches
from megatron_logra.sketch.sketch_set import SketchSet
from megatron_logra.sketch.targets import SketchTarget

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


class LograOptimizer(LograApplyMixin, LograNormsMixin, LograScheduleMixin, LograStateMixin):
    """LoGRA on the targets of ``model``; AdamW (or frozen) for the rest.

    Built here: the sketches, the native AdamW, row moments and masters; :meth:`prepare` and :meth:`step`.
    The rest of the class comes from mixins, one concern each: :meth:`apply` (:mod:`.logra_apply`), the
    update norms and model-parallel sums (:mod:`.logra_norms`), the scheduled lrs (:mod:`.logra_lr`) and the
    checkpoint contract (:mod:`.logra_state`)."""

    def __init__(
        self,
        model: Union[nn.Module, Sequence[nn.Module]],
        cfg: LograConfig,
        native: NativeConfig,
        groups: ParallelGroups,
        *,
        schedule: Optional[LRScheduleConfig] = None,
        total_steps: Optional[int] = None,
        loss_scale: Optional[LossScaleConfig] = None,
    ) -> None:
        """``schedule`` (None: constant lrs) with ``total_steps``, the job's optimizer steps that a schedule
        without ``decay_steps`` decays over (``ValueError`` when it needs them and they are missing);
        ``loss_scale`` (None: unscaled) for float16 models (:mod:`megatron_logra.optim.loss_scale`)."""
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
        self.scaler = build_loss_scaler(loss_scale, module_params(model))
        self.num_steps = 0
        self.num_skipped = 0

    @property
    def loss_scale(self) -> float:
        """What the next backward multiplies the loss by (``forward_backward(grad_scale=...)``); 1.0 unscaled."""
        return self.scaler.scale if self.scaler is not None else 1.0

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
        sketch_divisor, native_factor = float(dp), 1.0  # native grads were averaged over DP above
        if by_tokens:
            total = torch.tensor([float(num_tokens)], dtype=torch.float64, device=self.device)
            all_reduce_sum(total, self.groups.dp)
            if total.item() <= 0:
                raise ValueError("no valid tokens in this step (num_tokens summed over data parallel ranks is 0)")
            update.num_tokens = int(total.item())
            sketch_divisor, native_factor = total.item(), 1.0 / total.item()
        if self.scaler is not None:  # the backward ran on the loss times this scale
            update.loss_scale = self.loss_scale
            sketch_divisor, native_factor = sketch_divisor * update.loss_scale, native_factor / update.loss_scale
        if sketch_divisor != 1.0:
            ss.flat.div_(sketch_divisor)
        if native_factor != 1.0:
            self.native.scale_grads_(native_factor)

        bad = not (bool(torch.isfinite(ss.flat).all()) and self.native.all_finite())
        bad = reduce_flag_any(bad, self.groups.mp, self.device)
        update.overflow = account_step(self.scaler, bad)
        if bad:
            self.num_skipped += 1
            update.skipped, update.reason = True, skip_reason(update, self.scaler)
            if self.groups.is_rank0:  # every rank skips together (the flag is reduced above)
                (logger.info if update.overflow else logger.warning)(
                    "optimizer update %d skipped: %s (%d skipped so far)", update.step, update.reason,
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

    def step(self, num_tokens: Optional[int] = None) -> PreparedUpdate:
        """``prepare`` then ``apply`` with α = 1."""
        update = self.prepare(num_tokens)
        self.apply(update, 1.0)
        return update

"""Dense AdamW through the LoGRA optimizer interface, for side-by-side comparison.

Every trainable parameter gets a dense gradient: bf16 weights use fp32 main grads, fp32
masters and fp32 moments (18 bytes per parameter, as Megatron's mixed-precision optimizer).

With a learning-rate schedule (``optimizer.schedule``, :mod:`megatron_logra.optim.schedule`) each
step's lr is ``native.lr × lr_multiplier(step)`` (exactly ``schedule.min_lr`` at the floor of the decay:
``scheduled_lr``), set in :meth:`DenseAdamW.prepare`; without one
(``schedule=None``, e.g. the warm start, which sets its own lr) the lr is left as it is.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import nn

from megatron_logra.optim.config import NativeConfig
from megatron_logra.optim.loss_scale import (LossScaleConfig, account_step, build_loss_scaler, restore_scaler,
                                             scaler_fields, skip_reason)
from megatron_logra.optim.update import PreparedUpdate, module_params
from megatron_logra.optim.native import NativeAdamW, reduce_flag_any
from megatron_logra.optim.schedule import LRScheduleConfig, lr_multiplier, scheduled_lr
from megatron_logra.optim.state import SlotState
from megatron_logra.parallel import ParallelGroups, all_reduce_sum

__all__ = ["DenseAdamW"]


class DenseAdamW:
    """AdamW on all trainable parameters with ``zero_grad / prepare / apply / step``."""

    def __init__(
        self,
        model: Union[nn.Module, Sequence[nn.Module]],
        cfg: NativeConfig,
        groups: ParallelGroups,
        *,
        clip_grad: float = 1.0,
        schedule: Optional[LRScheduleConfig] = None,
        total_steps: Optional[int] = None,
        loss_scale: Optional[LossScaleConfig] = None,
    ) -> None:
        """``schedule`` (None: the lr stays as set) with ``total_steps``, the job's optimizer steps that a
        schedule without ``decay_steps`` decays over (``ValueError`` when it needs them and they are missing);
        ``loss_scale`` (None: unscaled) for float16 models (:mod:`megatron_logra.optim.loss_scale`)."""
        params = [p for p in module_params(model) if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters for dense AdamW")
        if schedule is not None and (total_steps is None or total_steps > 0):  # (a job of 0 steps takes none)
            schedule.resolve_decay_steps(total_steps)  # refuse a schedule that cannot be evaluated, before any step
        self.groups = groups
        self.clip_grad = clip_grad
        self.schedule = schedule
        self.total_steps = total_steps
        self.device = params[0].device
        self.native = NativeAdamW(
            params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, groups=groups
        )
        self.scaler = build_loss_scaler(loss_scale, params)
        self.num_steps = 0
        self.num_skipped = 0

    def zero_grad(self) -> None:
        self.native.zero_grad()

    def persistent_bytes(self) -> dict[str, int]:
        n = self.native.num_params()
        low = sum(p.numel() for p in self.native.params if p.dtype != torch.float32)
        return {"grads": n * 4, "masters": low * 4, "moments": n * 8}

    @property
    def loss_scale(self) -> float:
        """What the next backward multiplies the loss by (``forward_backward(grad_scale=...)``); 1.0 unscaled."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @torch.no_grad()
    def prepare(self, num_tokens: Optional[int] = None) -> PreparedUpdate:
        update = PreparedUpdate(step=self.num_steps + 1, update_index=self.num_steps)
        self.native.reduce_gradients(average=num_tokens is None)
        factor = 1.0
        if num_tokens is not None:
            total = all_reduce_sum(torch.tensor([float(num_tokens)], dtype=torch.float64, device=self.device), self.groups.dp)
            if total.item() <= 0:
                raise ValueError("no valid tokens in this step (num_tokens summed over data parallel ranks is 0)")
            update.num_tokens = int(total.item())
            factor = 1.0 / total.item()
        if self.scaler is not None:  # the backward ran on the loss times this scale
            update.loss_scale = self.loss_scale
            factor /= update.loss_scale
        if factor != 1.0:
            self.native.scale_grads_(factor)
        bad = reduce_flag_any(not self.native.all_finite(), self.groups.mp, self.device)
        update.overflow = account_step(self.scaler, bad)
        if bad:
            self.num_skipped += 1
            update.skipped, update.reason = True, skip_reason(update, self.scaler, "non-finite gradient")
            self.zero_grad()
            return update
        norm2 = all_reduce_sum(self.native.local_norm2(self.device).reshape(1), self.groups.mp)
        update.grad_norm = math.sqrt(norm2.item())
        if self.clip_grad > 0 and update.grad_norm > self.clip_grad:
            update.clip_coef = self.clip_grad / (update.grad_norm + 1e-6)
            self.native.scale_grads_(update.clip_coef)
        if self.schedule is not None:
            base = self.native.base_lr  # the lr --lr sets, the reference of an absolute min_lr
            update.lr_multiplier = lr_multiplier(update.step, self.schedule, self.total_steps, base)
            self.native.set_lr(scheduled_lr(base, update.step, self.schedule, self.total_steps, base))
        return update

    def step_lrs(self, update: PreparedUpdate) -> dict[str, Optional[float]]:
        """The learning rate ``update`` is (or was) applied with, for a step's metrics record: ``lr`` (AdamW's,
        after the schedule) and ``logra_lr`` (None: no LoGRA targets); both None for a skipped update."""
        if update.skipped:
            return {"lr": None, "logra_lr": None}
        return {"lr": float(self.native.inner.param_groups[0]["lr"]), "logra_lr": None}

    def apply(self, update: PreparedUpdate, alpha: float = 1.0) -> None:
        if update.skipped:
            return
        if alpha != 1.0:
            raise ValueError("dense AdamW applies its own step size; alpha must be 1.0")
        self.native.step()
        self.num_steps += 1
        self.zero_grad()

    def step(self, num_tokens: Optional[int] = None) -> PreparedUpdate:
        update = self.prepare(num_tokens)
        self.apply(update)
        return update

    def state_dict(self) -> dict:
        return {"kind": "adam", "num_steps": self.num_steps, "num_skipped": self.num_skipped,
                "native": self.native.state_dict(), **scaler_fields(self.scaler)}

    def sharded_state(self) -> SlotState:
        """AdamW moments and masters as parameter-shaped slots (:mod:`megatron_logra.optim.state`)."""
        native_scalars, slots = self.native.sharded_state("native")
        return {"kind": "adam", "num_steps": self.num_steps, "num_skipped": self.num_skipped,
                "native": native_scalars, **scaler_fields(self.scaler)}, slots

    def load_sharded_state(self, scalars: dict, slots: list) -> None:
        if scalars.get("kind") != "adam":
            raise ValueError(f"optimizer state is of kind {scalars.get('kind')!r}, expected 'adam'")
        self.native.load_sharded_state(scalars["native"], slots)
        self.num_steps = int(scalars["num_steps"])
        self.num_skipped = int(scalars.get("num_skipped", 0))
        restore_scaler(self.scaler, scalars)

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "adam":
            raise ValueError(f"optimizer state is of kind {state.get('kind')!r}, expected 'adam'")
        self.native.load_state_dict(state["native"])
        self.num_steps = int(state["num_steps"])
        self.num_skipped = int(state.get("num_skipped", 0))
        restore_scaler(self.scaler, state)

"""AdamW over ordinary (dense-gradient) parameters, Megatron-style.

Low-precision parameters accumulate their gradients into an fp32 ``main_grad`` (the
``.grad`` is folded in and dropped right after it is accumulated) and are stepped through
an fp32 master copy, as Megatron's mixed-precision optimizer does: 2 (weight) + 4 (grad)
+ 4 (master) + 8 (moments) = 18 bytes per parameter. fp32 parameters are their own masters.

Data-parallel gradient reduction is one coalesced all-reduce; word embeddings tied across
pipeline stages (``shared_embedding``) are summed over the embedding group.

Weight decay, as Megatron's ``get_param_groups``: 1-D parameters (norm weights and biases, which
are 1-D) are not decayed; with ``weight_decay > 0`` they form a second AdamW parameter group.

Saving and resuming the optimizer's state: :mod:`megatron_logra.optim.native_state`.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from megatron_logra.models.layout import is_tied_output_copy
from megatron_logra.optim.functional import adamw_delta
from megatron_logra.optim.native_state import NativeAdamWState
from megatron_logra.parallel import ParallelGroups, all_reduce_sum, group_size

logger = logging.getLogger(__name__)

__all__ = ["NativeAdamW"]


class NativeAdamW(NativeAdamWState):
    """AdamW with fp32 main grads and masters for a list of parameters."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        groups: ParallelGroups,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.groups = groups
        self.base_lr = lr
        """The configured (peak) learning rate: what :meth:`set_lr` schedules are fractions of, and what
        checkpoints record as this optimizer's lr."""
        self.masters: list[torch.Tensor] = []
        self._hooks = []
        for p in self.params:
            if p.dtype == torch.float32:
                self.masters.append(p)
                continue
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            master = p.detach().float().clone()
            self.masters.append(master)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._fold_grad))
        # positions (in self.params) of the masters in AdamW's flattened parameter-group order
        self._inner_order = _group_order(self.params, weight_decay)
        self.inner = None
        if self.params:
            param_groups = [{"params": [self.masters[i] for i in self._inner_order]}]
            if weight_decay != 0:  # 1-D parameters in a group of their own, without decay
                decayed = [self.masters[i] for i in self._inner_order if decays(self.params[i])]
                kept = [self.masters[i] for i in self._inner_order if not decays(self.params[i])]
                param_groups = ([{"params": decayed}] if decayed else []) + (
                    [{"params": kept, "weight_decay": 0.0}] if kept else [])
            self.inner = torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @staticmethod
    def _fold_grad(p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    def set_lr(self, lr: float) -> None:
        """Learning rate of the following steps (schedules call this before each step); :attr:`base_lr`,
        the configured one, stays."""
        if self.inner is not None:
            for group in self.inner.param_groups:
                group["lr"] = lr

    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradient of every parameter (zeros where backward produced none)."""
        out = []
        for p, m in zip(self.params, self.masters):
            if m is p:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.append(p.grad)
            else:
                out.append(p.main_grad)
        return out

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            if m is p:
                p.grad = None
            else:
                p.main_grad.zero_()

    def reduce_gradients(self, *, average: bool) -> None:
        """Sum (or average) gradients over data parallel ranks in one collective, tied
        embeddings over the first/last pipeline stage, and sequence-parallel partial grads of
        TP-replicated parameters over the TP group."""
        grads = self.grads()
        if not grads:
            return
        if group_size(self.groups.tp) > 1:
            # under sequence parallelism each TP rank saw a slice of the sequence: parameters replicated
            # over TP (norm weights, marked ``sequence_parallel`` by megatron-core) hold partial grads
            partial = [g for p, g in zip(self.params, grads) if getattr(p, "sequence_parallel", False)]
            if partial:
                flat = torch.cat([g.reshape(-1) for g in partial])
                dist.all_reduce(flat, group=self.groups.tp)
                offset = 0
                for g in partial:
                    g.copy_(flat[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()
        if self.groups.embedding is not None and group_size(self.groups.embedding) > 1:
            for p, g in zip(self.params, grads):
                if getattr(p, "shared_embedding", False):
                    dist.all_reduce(g, group=self.groups.embedding)
        dp = group_size(self.groups.dp)
        if dp == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.groups.dp)
        if average:
            flat.div_(dp)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n

    def local_norm2(self, device: torch.device) -> torch.Tensor:
        """This rank's share of the global grad norm²: TP-replicated params counted on TP rank 0 only,
        and the last pipeline stage's copy of tied word embeddings (megatron marks it ``shared``; after
        the embedding-group reduction it holds the same gradient as the first stage's) not at all,
        as megatron's ``param_is_not_shared``."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        tp_rank = self.groups.tp_rank
        for p, g in zip(self.params, self.grads()):
            if is_tied_output_copy(p):
                continue
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                total += g.double().pow(2).sum()
        return total

    def all_finite(self) -> bool:
        return all(bool(torch.isfinite(g).all()) for g in self.grads())

    def scale_grads_(self, factor: float) -> None:
        for g in self.grads():
            g.mul_(factor)

    @torch.no_grad()
    def step(self, scale: float = 1.0) -> None:
        """One AdamW step; ``scale`` multiplies the parameter change (the moments advance as
        usual), so a step-size controller can shorten the native part of an update with the rest."""
        if self.inner is None:
            return
        for p, m, g in zip(self.params, self.masters, self.grads()):
            if m is not p:
                m.grad = g
        before = [m.clone() for m in self.masters] if scale != 1.0 else None
        self.inner.step()
        if before is not None:
            for m, old in zip(self.masters, before):
                m.sub_(old).mul_(scale).add_(old)
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)
                m.grad = None

    @torch.no_grad()
    def planned_deltas(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(parameter, θ' − θ)`` for every parameter: the change :meth:`step` (``scale=1``) would make
        now to its fp32 master, in fp32, nothing modified (moments advanced, bias-corrected, the
        decoupled decay of its group; :func:`~megatron_logra.optim.functional.adamw_delta`).
        ``step(scale)`` changes each master by ``scale·Δ``. Call after the gradients are reduced and
        clipped (``prepare``); empty without parameters. Costs one fp32 copy of the parameters."""
        if self.inner is None:
            return []
        if not isinstance(self.inner, torch.optim.AdamW):
            raise TypeError(f"planned_deltas needs torch.optim.AdamW, this optimizer steps with {type(self.inner).__name__}")
        group_of = {id(m): g for g in self.inner.param_groups for m in g["params"]}
        out = []
        for p, m, grad in zip(self.params, self.masters, self.grads()):
            hp = group_of[id(m)]
            if hp.get("amsgrad") or hp.get("maximize"):
                raise ValueError("planned_deltas covers plain AdamW only (no amsgrad, no maximize)")
            st = self.inner.state.get(m, {})
            beta1, beta2 = hp["betas"]
            delta = adamw_delta(m.detach(), grad, st.get("exp_avg"), st.get("exp_avg_sq"),
                                int(st["step"]) if "step" in st else 0, lr=float(hp["lr"]), beta1=beta1,
                                beta2=beta2, eps=hp["eps"], weight_decay=hp["weight_decay"])
            out.append((p, delta))
        return out

    def _warn_lr_change(self, saved_lr: Optional[float]) -> None:
        # the run's configuration wins, as it does for LoGRA's own learning rate
        if saved_lr is not None and float(saved_lr) != self.base_lr:
            logger.warning("resuming AdamW (non-LoGRA parameters) at lr %g from this run's configuration; the "
                           "checkpoint was saved at lr %g", self.base_lr, float(saved_lr))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def decays(p: torch.Tensor) -> bool:
    """Whether AdamW's decoupled weight decay applies to ``p``: not to 1-D parameters (norm weights,
    biases), as Megatron's ``get_param_groups`` decides."""
    return p.dim() > 1


def _group_order(params: list[torch.Tensor], weight_decay: float) -> list[int]:
    """Positions of ``params`` in AdamW's flattened group order: decayed first, then the rest
    (one group in the original order when nothing is decayed)."""
    if weight_decay == 0:
        return list(range(len(params)))
    return ([i for i, p in enumerate(params) if decays(p)]
            + [i for i, p in enumerate(params) if not decays(p)])


def reduce_flag_any(flag: bool, group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """True if ``flag`` is True on any rank of ``group``."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce_sum(t, group)
    return bool(t.item() > 0)

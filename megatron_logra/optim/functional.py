"""Pure numerical cores of the LoGRA optimizer (no process groups, no module state).

Also :func:`adamw_delta`: the parameter change of one AdamW step, computed without taking it
(the predicted-KL probe gives the native parameters that change as their tangent).

Shapes: a sketch ``S`` is ``[n_out, r]`` (``sketch_OR``), a projection ``A`` is
``[r, n_in]`` (``proj_RI``), a direction ``D`` has the sketch's shape, row moments ``v``
are ``[n_out]``. The reconstructed gradient is ``S·A``; the weight update is ``ΔW = −c·D·A``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "row_adam_direction",
    "reconstructed_norm2",
    "apply_low_rank_update_",
    "adamw_delta",
]


def row_adam_direction(
    sketch_OR: torch.Tensor, v_O: torch.Tensor, step: int, beta2: float, eps: float
) -> torch.Tensor:
    """RowAdam: one second moment per output row, no first moment.

    ``v_i ← β2·v_i + (1−β2)·mean_j S_ij²`` (updated in place), then
    ``D_ij = S_ij / (sqrt(v_i / (1−β2^t)) + ε)`` for the 1-based ``step`` t.
    """
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based), got {step}")
    v_O.mul_(beta2).add_(sketch_OR.pow(2).mean(dim=1), alpha=1.0 - beta2)
    denom_O = (v_O / (1.0 - beta2**step)).sqrt_().add_(eps)
    return sketch_OR / denom_O[:, None]


def reconstructed_norm2(sketch_OR: torch.Tensor, proj_RI: torch.Tensor) -> torch.Tensor:
    """``‖S·A‖_F²`` through the ``r×r`` Gram: ``Σ ((S·AAᵀ) ⊙ S)`` (fp64 scalar).

    With ``A`` a column block of the full projection this is that block's share; summing
    the shares of all blocks gives the full norm.
    """
    gram_RR = proj_RI.double() @ proj_RI.double().t()
    s = sketch_OR.double()
    return ((s @ gram_RR) * s).sum()


@torch.no_grad()
def apply_low_rank_update_(
    weight: torch.Tensor,
    factor_OR: torch.Tensor,
    proj_RI: torch.Tensor,
    *,
    decay: float = 1.0,
    master: Optional[torch.Tensor] = None,
) -> None:
    """``W ← decay·W − factor·A`` in place, in fp32: on the fp32 ``master`` (then copied, rounded to
    nearest, into ``weight``) or on an fp32 ``weight`` itself.

    A 16-bit weight without a master is merged by :func:`megatron_logra.sync.apply.low_rank_merge_`
    (row chunks, stochastic rounding), which is what the optimizer calls; here it is a ``ValueError``.
    """
    factor = factor_OR.float()
    proj = proj_RI.float()
    if master is not None:
        if decay != 1.0:
            master.mul_(decay)
        master.addmm_(factor, proj, alpha=-1.0)
        weight.copy_(master)
        return
    if weight.dtype != torch.float32:
        raise ValueError(f"apply_low_rank_update_: a {weight.dtype} weight needs an fp32 master; merge 16-bit "
                         "weights without one with megatron_logra.sync.apply.low_rank_merge_")
    if decay != 1.0:
        weight.mul_(decay)
    weight.addmm_(factor, proj, alpha=-1.0)


@torch.no_grad()
def adamw_delta(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: Optional[torch.Tensor],
    exp_avg_sq: Optional[torch.Tensor],
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> torch.Tensor:
    """``θ' − θ`` of one ``torch.optim.AdamW`` step (no amsgrad, not maximize), nothing modified.

    ``param`` is θ before the step (the fp32 master), ``exp_avg`` / ``exp_avg_sq`` the moments
    before it and ``step`` the number of steps already taken (0: no moments yet, which may then
    be None). The step that is *not* taken here would do, for ``t = step + 1``::

        m ← β1·m + (1−β1)·g,  v ← β2·v + (1−β2)·g²
        θ' = (1 − lr·wd)·θ − lr/(1−β1ᵗ) · m / (sqrt(v/(1−β2ᵗ)) + ε)

    Computed in ``param``'s dtype with AdamW's own order of operations, so it equals the
    change AdamW makes up to the rounding of ``θ'`` itself. Returns a new tensor.
    """
    if step < 0:
        raise ValueError(f"step={step} must be >= 0 (steps already taken)")
    g = grad.to(param.dtype)
    m = torch.zeros_like(param) if exp_avg is None else exp_avg.to(param.dtype)
    m = m.lerp(g, 1.0 - beta1)
    v = torch.zeros_like(param) if exp_avg_sq is None else exp_avg_sq.to(param.dtype)
    v = (v * beta2).addcmul_(g, g, value=1.0 - beta2)
    t = step + 1
    step_size = lr / (1.0 - beta1**t)
    denom = v.sqrt_().div_((1.0 - beta2**t) ** 0.5).add_(eps)
    delta = m.div_(denom).mul_(-step_size)
    if weight_decay != 0:
        delta.sub_(param, alpha=lr * weight_decay)
    return delta

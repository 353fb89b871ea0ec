"""Policy-gradient losses on per-token log-probs (pure functions, summed over tokens).

All take ``[b, s]`` tensors aligned with the labels and a 0/1 ``mask`` of completion tokens,
and return the *sum* over masked tokens; the optimizer divides by the global token count
(token-level normalisation).

* TIS: ``−w·A·log π_θ`` with ``w = clamp(exp(log π_θ − log μ), floor, cap)`` detached, where ``μ`` is
  the rollout engine's policy (truncated importance sampling against rollout log-probs; ``floor`` 0 by default,
  slime's ``--tis-clip-low``).
* PPO-clip with clip-higher: ``−min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A)``, ``ρ = π_θ / π_old``; with dual clip
  (``c > 1``, slime's ``--eps-clip-c``) a token of negative advantage loses at most ``−c·A``, however large ``ρ``.
* GSPO (Zheng et al. 2025, slime's ``--advantage-estimator gspo``): the same clipped surrogate on every token of a
  completion with its sequence-level ratio ``s = exp(mean_t (log π_θ − log π_old))`` over the completion's loss
  tokens, so a completion is clipped as a whole; its gradient on each token is ``s·A·∇log π_θ``. Sequence ratios
  stay much closer to 1 than token ratios: the GSPO paper clips at ε ≈ 3e-4 / 4e-4, not 0.2 / 0.28.
* KL penalty to a frozen reference, one of Schulman's per-token estimators on the policy's own samples,
  with ``x = log π_ref − log π_θ``: k2 ``x²/2`` or k3 ``exp(x) − x − 1``. As loss terms (the samples
  held fixed, the gradient through ``log π_θ`` only) their expected gradients differ: k2's is that of
  KL(π_θ ‖ π_ref), k3's that of the reverse KL(π_ref ‖ π_θ) (the GRPO / DeepSeek choice). ``low_var_kl``
  is k3 clamped to at most :data:`LOW_VAR_KL_MAX` per token (slime's and verl's ``kl_loss_type=low_var_kl``):
  k3's gradient wherever a token's k3 is below the clamp, none where a token has drifted past it. k1 ``−x`` is
  unbiased for KL(π_θ ‖ π_ref) as a *value* but its expected gradient is zero on-policy, so it regularises
  nothing as a loss: :func:`kl_penalty` computes it (a metric), the loss refuses it.
* Entropy bonus (slime's and verl's ``entropy_coef``): ``−c·Σ_t H_t`` over the masked tokens, ``H_t`` the
  entropy of the whole next-token distribution ``softmax(z_t/τ)`` at the sampling temperature, summed with the
  same token normalisation as the policy-gradient term. Its gradient is exact (``∂H/∂z_v = −p_v(log p_v + H)/τ``,
  computed chunk by chunk with the log-prob's by :mod:`megatron_logra.rl.logprobs`, vocabulary-parallel); at
  ``c = 0`` the term is not built, so the loss, its graph and its backward are those without it.

Per-token log-probs come from vocabulary-parallel logits through :mod:`megatron_logra.rl.logprobs`
(chunks of ``LossConfig.logprob_chunk_tokens`` tokens, no fp32 ``[tokens, vocab]`` tensor for the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_logra.rl.checks import check_finite_fields
from megatron_logra.rl.logprobs import DEFAULT_CHUNK_TOKENS, chunked_logprobs_and_entropy, chunked_token_logprobs

LOW_VAR_KL_MAX = 10.0
"""The per-token cap of the ``low_var_kl`` estimator (k3 clamped to [−10, 10], as slime and verl clamp it; k3 ≥ 0)."""

KL_ESTIMATORS = ("k2", "k3", "low_var_kl")
"""The estimators ``rl.loss.kl_estimator`` takes as a loss term."""

__all__ = ["LossConfig", "KL_ESTIMATORS", "LOW_VAR_KL_MAX", "tis_pg_loss", "ppo_clip_loss", "gspo_loss", "kl_penalty",
           "entropy_bonus", "token_logprobs", "token_logprobs_and_entropy"]


@dataclass
class LossConfig:
    """The RL objective."""

    kind: str = "tis"
    """tis (policy gradient with truncated importance sampling), ppo (PPO-clip) or gspo (PPO-clip on each
    completion's sequence-level ratio; set clip_low / clip_high to GSPO's scale, e.g. 3e-4 / 4e-4)."""
    tis_cap: float = 2.0
    """TIS: cap on the importance weight π_θ / μ."""
    tis_floor: float = 0.0
    """TIS: lower bound of the importance weight (slime's ``--tis-clip-low``); 0 = none (the weight is positive)."""
    clip_low: float = 0.2
    """PPO / GSPO: ε_low."""
    clip_high: float = 0.28
    """PPO / GSPO: ε_high (clip-higher)."""
    clip_c: float = 0.0
    """PPO / GSPO: dual clip (slime's ``--eps-clip-c``): a token of negative advantage A contributes at most ``−c·A`` to the
    loss, bounding the step a very unlikely token can take; must be > 1 where set; 0 = off. TIS does not read it."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the initial (reference) policy; 0 disables it."""
    kl_estimator: str = "k3"
    """k3 (``exp(x) − x − 1``, x = log π_ref − log π_θ: pulls along the gradient of KL(π_ref ‖ π_θ)) or k2
    (``x²/2``: the gradient of KL(π_θ ‖ π_ref)) or low_var_kl (k3 clamped to at most 10 per token, slime's and
    verl's); see the module docstring (k1 is refused: zero expected gradient). The metrics' ``ref_kl`` uses
    the same estimator."""
    entropy_coef: float = 0.0
    """Weight ``c`` of the entropy bonus (slime's / verl's ``--entropy-coef``): ``−c·Σ H_t`` over the loss tokens
    is added to the summed loss, ``H_t`` the entropy of the full next-token distribution at the sampling
    temperature, to keep exploration up; 0 (default) leaves the loss and its compute exactly as without it, and
    the ``entropy`` metric is logged either way."""
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens per chunk when turning logits into log-probs and entropy: the fp32 working set is two
    ``[chunk, V/tp]`` buffers in forward and in backward instead of several ``[tokens, V/tp]`` ones;
    0 processes the whole micro-batch as one chunk."""

    def __post_init__(self) -> None:
        check_finite_fields("rl.loss", self)  # first: nan passes the comparisons below
        if self.kind not in ("tis", "ppo", "gspo"):
            raise ValueError(f"rl.loss.kind={self.kind!r}: choose tis, ppo or gspo")
        if self.tis_cap <= 0:
            raise ValueError(f"rl.loss.tis_cap={self.tis_cap} must be > 0")
        if not 0 <= self.tis_floor < self.tis_cap:
            raise ValueError(f"rl.loss.tis_floor={self.tis_floor} must lie in [0, rl.loss.tis_cap={self.tis_cap}) "
                             f"(0 = no lower bound)")
        if self.clip_c != 0 and not self.clip_c > 1:
            raise ValueError(f"rl.loss.clip_c={self.clip_c}: PPO's dual clip must be > 1 (e.g. 3, as in the dual-clip "
                             f"PPO paper), or 0 for none")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"rl.loss.clip_low={self.clip_low} must lie in [0, 1)")
        if self.clip_high < 0:
            raise ValueError(f"rl.loss.clip_high={self.clip_high} must be >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"rl.loss.kl_coef={self.kl_coef} must be >= 0")
        if isinstance(self.entropy_coef, bool) or not isinstance(self.entropy_coef, (int, float)) \
                or not math.isfinite(self.entropy_coef) or self.entropy_coef < 0:
            raise ValueError(f"rl.loss.entropy_coef={self.entropy_coef!r} must be a finite number >= 0 "
                             "(0 = no entropy bonus)")
        if self.kl_estimator == "k1":
            raise ValueError("rl.loss.kl_estimator=k1 has an expected gradient of zero on the policy's own samples: as "
                             "a loss term it adds noise and pulls nowhere; choose k2 (the gradient of KL(π_θ ‖ π_ref)) "
                             "or k3 (the default: the gradient of KL(π_ref ‖ π_θ)), or low_var_kl (k3 clamped)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"rl.loss.kl_estimator={self.kl_estimator!r}: choose k2, k3 or low_var_kl")
        if isinstance(self.logprob_chunk_tokens, bool) or not isinstance(self.logprob_chunk_tokens, int) \
                or self.logprob_chunk_tokens < 0:
            raise ValueError(f"rl.loss.logprob_chunk_tokens={self.logprob_chunk_tokens!r} must be an integer >= 0 "
                             "(0 = the whole micro-batch in one chunk)")


def token_logprobs(logits_bsV: torch.Tensor, labels_bs: torch.Tensor, temperature: float, tp_group=None,
                   chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """``log softmax(z/τ)[label]`` per position, with vocabulary-parallel logits (differentiable),
    ``chunk_tokens`` tokens at a time (default :data:`~megatron_logra.rl.logprobs.DEFAULT_CHUNK_TOKENS`)."""
    return chunked_token_logprobs(logits_bsV, labels_bs, temperature, tp_group, chunk_tokens)


def token_logprobs_and_entropy(logits_bsV: torch.Tensor, labels_bs: torch.Tensor, temperature: float, tp_group=None,
                               chunk_tokens: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``token_logprobs``, entropy of ``softmax(z/τ)``) per position from one chunked pass."""
    return chunked_logprobs_and_entropy(logits_bsV, labels_bs, temperature, tp_group, chunk_tokens)


def tis_pg_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cap: float, floor: float = 0.0) -> torch.Tensor:
    weight = torch.exp(logp.detach() - rollout_logp).clamp(max=cap)
    if floor > 0:
        weight = weight.clamp(min=floor)
    return -(weight * advantages * logp * mask).sum()


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_low: float, clip_high: float, clip_c: float = 0.0) -> torch.Tensor:
    return _clipped_surrogate(torch.exp(logp - old_logp), advantages, mask, clip_low, clip_high, clip_c)


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float, clip_c: float = 0.0) -> torch.Tensor:
    """GSPO: :func:`ppo_clip_loss` with each row's sequence-level ratio ``exp(Σ_t m_t (log π_θ − log π_old) /
    Σ_t m_t)`` on every token of the row (differentiable through every token's log-prob); a row without loss
    tokens contributes 0. Rows are whole completions: micro-batches never split one."""
    log_ratio = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp))
    tokens = mask.sum(dim=1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True) / tokens).expand_as(logp)
    return _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high, clip_c)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float,
                       clip_high: float, clip_c: float) -> torch.Tensor:
    """``Σ −min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A)`` over the masked tokens, each token of negative advantage at
    most ``−c·A`` with a dual clip ``c > 0``."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    if clip_c <= 0:
        return -(torch.minimum(unclipped, clipped) * mask).sum()
    per_token = -torch.minimum(unclipped, clipped)
    per_token = torch.where(advantages < 0, torch.minimum(per_token, -clip_c * advantages), per_token)
    return (per_token * mask).sum()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Σ over masked tokens of Schulman's per-token KL estimator ``k1`` (−x), ``k2`` (x²/2) or ``k3``
    (exp(x) − x − 1), x = ``ref_logp − logp``, or ``low_var_kl`` (k3 clamped to at most
    :data:`LOW_VAR_KL_MAX`); see the module docstring for their gradients."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        per_token = -log_ratio
    elif estimator == "k2":
        per_token = 0.5 * log_ratio * log_ratio
    elif estimator in ("k3", "low_var_kl"):
        per_token = torch.exp(log_ratio) - log_ratio - 1.0
        if estimator == "low_var_kl":
            per_token = per_token.clamp(max=LOW_VAR_KL_MAX)
    else:
        raise ValueError(f"estimator={estimator!r}: choose k1, k2, k3 or low_var_kl")
    return (per_token * mask).sum()


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t H_t`` over the masked tokens (``entropy``, ``mask``: ``[b, s]``); the loss subtracts it times
    ``entropy_coef``."""
    return (entropy * mask).sum()


def rl_loss(cfg: LossConfig, logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor, ref_logp: Optional[torch.Tensor] = None,
            entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The configured objective (sum over masked tokens): the policy-gradient term, ``+ kl_coef·KL`` with
    ``ref_logp`` and ``− entropy_coef·Σ H`` with ``entropy`` (``[b, s]``, differentiable: the per-token entropy
    of :func:`token_logprobs_and_entropy`). Each term is built only when its coefficient is above 0."""
    if cfg.kind == "tis":
        loss = tis_pg_loss(logp, rollout_logp, advantages, mask, cfg.tis_cap, cfg.tis_floor)
    elif cfg.kind == "gspo":
        loss = gspo_loss(logp, rollout_logp, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.clip_c)
    else:
        loss = ppo_clip_loss(logp, rollout_logp, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.clip_c)
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("rl.loss.kl_coef > 0 needs reference log-probs")
        loss = loss + cfg.kl_coef * kl_penalty(logp, ref_logp, mask, cfg.kl_estimator)
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("rl.loss.entropy_coef > 0 needs the per-token entropy")
        loss = loss - cfg.entropy_coef * entropy_bonus(entropy, mask)
    return loss

"""The RL step's training objective: the per-micro-batch loss function and the reference model's log-probs.

Contract: :func:`make_rl_loss_fn` builds the ``loss_fn`` ``forward_backward`` calls on each micro-batch
(the RL loss, plus the rollout/trainer log-prob mismatch, the policy entropy and the KL to the reference as
summed reports); :func:`_reference_logprobs` runs the frozen reference model through the same pipeline
schedule, one training micro-batch at a time, and returns its per-token log-probs on the last pipeline stage;
:func:`backward_and_prepare` runs the step's forward/backward and prepares the update, at the optimizer's loss
scale, again on the same batch for as long as a float16 overflow lowers the scale.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_logra.rl.batching import MicroSlice, plan_microbatches, scatter_rows, take_microbatch
from megatron_logra.rl.losses import kl_penalty, rl_loss, token_logprobs, token_logprobs_and_entropy
from megatron_logra.train.step import Batch, forward_backward

if TYPE_CHECKING:
    from megatron_logra.rl.loop import RLComponents
    from megatron_logra.train.step import StepResult

logger = logging.getLogger(__name__)

__all__ = ["backward_and_prepare", "make_rl_loss_fn"]


def make_rl_loss_fn(loss_cfg, temperature: float, tp_group):
    """The per-micro-batch RL objective for ``forward_backward``; also reports the mismatch
    ``Σ (rollout_logprob − trainer_logprob)`` over tokens of completed sequences and the summed
    policy entropy at the sampling temperature over the loss tokens and, with ``ref_logprobs`` in the
    batch, the summed KL to the reference by the penalty's estimator (``[0, 0]`` without). With
    ``rl.loss.entropy_coef > 0`` the loss carries the entropy bonus through the same chunked pass (the entropy's
    gradient flows into the logits' backward with the log-probs'); the reported ``entropy`` is the same
    quantity either way, and ``lm`` is the whole objective."""

    def loss_fn(batch: Batch, logits: torch.Tensor):
        logp, entropy = token_logprobs_and_entropy(logits, batch.labels, temperature, tp_group,
                                                   loss_cfg.logprob_chunk_tokens)
        mask = batch.loss_mask
        ref = batch.extras.get("ref_logprobs")
        loss = rl_loss(loss_cfg, logp, batch.extras["rollout_logprobs"], batch.extras["advantages"], mask, ref,
                       entropy=entropy)
        finished = batch.extras["finished"] * mask
        # selected, not multiplied: a non-finite log-prob off the completed tokens must not reach the sum
        gap = torch.where(finished > 0, batch.extras["rollout_logprobs"] - logp.detach(), 0.0).sum()
        # the penalty's own estimator of KL(π_θ ‖ π_ref) over the loss tokens (0 tokens: no reference)
        if ref is None:
            ref_kl = logp.new_zeros(2, dtype=torch.float32)
        else:
            ref_kl = torch.stack([kl_penalty(logp.detach(), ref, mask, loss_cfg.kl_estimator).float(), mask.sum().float()])
        report = {
            "lm": torch.stack([loss.detach().float(), mask.sum()]),
            "mismatch": torch.stack([gap.float(), finished.sum()]),
            "entropy": torch.stack([(entropy.detach() * mask).sum().float(), mask.sum().float()]),
            "ref_kl": ref_kl,
        }
        return loss, mask.sum().to(torch.int), report

    loss_fn.report_names = ["mismatch", "entropy", "ref_kl"]
    return loss_fn


def _reference_logprobs(c: RLComponents, batch: Batch,
                        plan: Optional[list[MicroSlice]] = None) -> Optional[torch.Tensor]:
    """Per-token log-probs ``[b, s]`` of the reference model on the last pipeline stage (``None`` on the
    others, whose micro-batches never reach the loss), one training micro-batch at a time through the
    same pipeline schedule as the policy (the logits of the whole step's batch at once would be
    ``[b, s, V/tp]``: tens of GB at scale). ``plan``: the step's :func:`step_plan` (None: made here)."""
    parts: list[torch.Tensor] = []
    temperature, chunk = c.cfg.rl.rollout.temperature, c.cfg.rl.loss.logprob_chunk_tokens

    def capture(mb: Batch, logits: torch.Tensor):
        parts.append(token_logprobs(logits, mb.labels, temperature, c.groups.tp, chunk))
        tokens = mb.loss_mask.sum()
        return logits.new_zeros((), dtype=torch.float32), tokens.to(torch.int), \
            {"lm": torch.stack([tokens.new_zeros((), dtype=torch.float32), tokens.float()])}

    plan = step_plan(c, batch) if plan is None else plan
    with torch.no_grad():
        forward_backward(c.ref_model, [take_microbatch(batch, part) for part in plan], c.groups,
                         forward_only=True, loss_fn=capture)
    return scatter_rows([p.cpu() for p in parts], plan, tuple(batch.tokens.shape)) if parts else None


def step_plan(c: RLComponents, batch: Batch) -> list[MicroSlice]:
    """The step's micro-batches: ``rl.micro_batch_size`` rows each, or by ``rl.max_tokens_per_micro_batch``
    (:func:`~megatron_logra.rl.batching.plan_microbatches`); the reference and the policy take the same."""
    rl = c.cfg.rl
    return plan_microbatches(batch, rl.micro_batch_size, rl.max_tokens_per_micro_batch, c.cfg.sequence_multiple())


def backward_and_prepare(c: RLComponents, batch: Batch, loss_fn, step: int, phases: Any,
                         plan: Optional[list[MicroSlice]] = None) -> tuple[StepResult, Any, int]:
    """Forward/backward of ``batch`` at the optimizer's loss scale, then ``optimizer.prepare``; returns the
    result, the prepared update and how many times it was re-run. ``phases`` (a ``Phases``) names the profiler
    ranges ``forward_backward`` and ``prepare``; ``plan``: the step's :func:`step_plan` (None: made here).

    A float16 overflow (``update.overflow``: the loss scale came down or is on its way) re-runs the
    forward/backward on the same batch rather than skipping the step: the rollouts are the expensive part
    of an RL step, and the same sequences at a smaller scale are a valid step. Each overflow counts towards
    the scaler's hysteresis, so the scale halves every ``optimizer.loss_scale.hysteresis`` re-runs until the
    step fits or the scale reaches ``min_scale``, where an overflow is a non-finite update like any other
    (returned skipped, without ``overflow``)."""
    micro = [take_microbatch(batch, part) for part in (step_plan(c, batch) if plan is None else plan)]
    retries = 0
    while True:
        phases.next("forward_backward")
        c.optimizer.zero_grad()
        result = forward_backward(c.model, micro, c.groups, loss_fn=loss_fn,
                                  grad_scale=getattr(c.optimizer, "loss_scale", 1.0))
        phases.next("prepare")
        update = c.optimizer.prepare(num_tokens=result.num_tokens)
        if not (update.skipped and getattr(update, "overflow", False)):
            break
        retries += 1
        if c.groups.is_rank0:
            logger.info("step %d: %s; the forward/backward runs again on the same rollouts", step, update.reason)
    return result, update, retries

"""The RL training loop. One update reads top to bottom:

rollout → reward → advantage → forward/backward → prepare update → KL control → apply → sync.

The state an update carries and the objects it works on (:class:`RLState`, :class:`RLComponents`) live in
:mod:`megatron_logra.rl.loop_state`, prompt tokenization and fit checks in :mod:`megatron_logra.rl.prompts`,
the loss function and the reference log-probs in :mod:`megatron_logra.rl.objective`, the KL probe's inputs in
:mod:`megatron_logra.rl.kl_probe`, held-out accuracy in :mod:`megatron_logra.rl.evaluation`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

import torch

from megatron_logra.kl.fd_probe import predicted_kl_fd
from megatron_logra.kl.probe import measure_kl, predicted_kl, probe_logits, probe_method
from megatron_logra.metrics import device_peaks, elapsed, reset_device_peaks
from megatron_logra.optim import LograOptimizer
from megatron_logra.parallel import all_reduce_sum
from megatron_logra.profiling import Phases
from megatron_logra.rl.advantages import EMABaseline, grpo_advantages, whiten_advantages
from megatron_logra.rl.batching import pack_sequences
from megatron_logra.rl.evaluation import evaluate_accuracy
from megatron_logra.rl.kl_probe import _probe_batch, fd_steps
from megatron_logra.rl.loop_state import RLComponents, RLState
from megatron_logra.rl.objective import _reference_logprobs, backward_and_prepare, make_rl_loss_fn, step_plan
from megatron_logra.rl.prompts import _decode, check_prompt_fits, prompt_room, rl_prompt_ids
from megatron_logra.rl.rollout_stage import collect_groups
from megatron_logra.rl.sample_log import sample_records
from megatron_logra.rl.source_metrics import source_fields
from megatron_logra.rl.step_guard import (check_measured_kl, kl_errors_name_step, refuse_update, trained_abs_advantage,
                                          update_applied, zero_advantage_reason)
from megatron_logra.train.step import model_device

logger = logging.getLogger(__name__)

__all__ = ["RLState", "RLComponents", "rl_update", "reinforce_advantages",
           # re-exported from their own modules (rl.loop_state, rl.evaluation, rl.objective, rl.prompts)
           "evaluate_accuracy", "make_rl_loss_fn", "check_prompt_fits", "prompt_room", "rl_prompt_ids"]


def reinforce_advantages(baseline: EMABaseline, rewards: torch.Tensor,
                         dp_group: Optional[torch.distributed.ProcessGroup]) -> torch.Tensor:
    """REINFORCE advantages of this data-parallel rank's ``rewards`` against ``baseline``, which then
    moves by the mean reward of the whole global batch (sum and count all-reduced over ``dp_group``;
    ``None`` or one rank: these rewards alone). Every DP rank thus keeps the same baseline, and the
    result equals one process's on all ranks' rewards (up to the order of the float64 sum)."""
    totals = torch.tensor([rewards.double().sum().item(), float(rewards.numel())], dtype=torch.float64)
    all_reduce_sum(totals, dp_group)
    return baseline.advantages(rewards, totals[0].item(), int(totals[1].item()))


def _dp_sums(group: Any, **values: float) -> dict[str, float]:
    """``values`` summed over the DP ranks (one all-reduce; every DP rank must call with the same names)."""
    totals = torch.tensor(list(values.values()), dtype=torch.float64)
    all_reduce_sum(totals, group)
    return dict(zip(values, totals.tolist()))


def rl_update(c: RLComponents, state: RLState) -> dict:
    """One RL update; returns its metrics record. Each phase is a named range (``rl/rollout``, ...) in a
    profile (:mod:`megatron_logra.profiling`)."""
    with Phases("rl") as ph:
        return _rl_update(c, state, ph)


def _rl_update(c: RLComponents, state: RLState, ph: Phases) -> dict:
    cfg, rl, groups = c.cfg, c.cfg.rl, c.groups
    step = state.step + 1
    device = model_device(c.model)
    reset_device_peaks(device)
    t0 = time.perf_counter()

    # ---- rollout and reward: this DP rank's groups of G samples, from the engine's current policy (with dynamic
    # sampling, groups of equal rewards are replaced by fresh prompts' groups: rl.rollout_stage)
    collected = collect_groups(c, step, ph)
    rollouts, rewards = collected.rollouts, collected.rewards_N
    rollout_seconds = collected.generate_seconds

    # ---- advantage
    ph.next("advantage")
    rewards_f32 = rewards.float()  # the exact rewards are logged; the advantages come from their float32 values
    if rl.advantage.estimator == "grpo":
        advantages = grpo_advantages(rewards_f32, rl.group_size, scale_by_std=rl.advantage.scale_by_std,
                                     eps=rl.advantage.eps, baseline=rl.advantage.baseline)
    else:
        advantages = reinforce_advantages(state.baseline, rewards_f32, groups.dp)
    raw_std = None  # rl.advantage.normalize: whitened over the loss tokens of every DP rank (rl.advantages)
    if rl.advantage.normalize:
        advantages, raw_std = whiten_advantages(advantages, [len(r.completion_ids) for r in rollouts], groups.dp)
    if c.sample_log is not None and c.sample_log.enabled:  # the first rollouts of the batch, as trained on
        shown = rollouts[: c.sample_log.limit]
        c.sample_log.write(sample_records(
            step, "train", [p for p in collected.problems for _ in range(rl.group_size)],
            [_decode(c, r.completion_ids) for r in shown], shown,
            list(zip(rewards.tolist(), collected.correct_N.bool().tolist())), advantages.tolist()))
    # generated: every rollout of the step (all rounds) — the policy's statistics, unbiased by the selection
    generated = dict(zip(("reward", "correct", "samples", "tokens"), collected.generated_4.tolist()))
    sums = _dp_sums(groups.dp, **generated, batch_tokens=float(sum(len(r.completion_ids) for r in rollouts)),
                    batch=float(len(rollouts)), truncated=float(sum(not r.finished for r in rollouts)),
                    abs_advantage=trained_abs_advantage(advantages, rollouts), prompts_skipped=float(collected.prompts_skipped),
                    resampled=float(collected.replaced), uniform=float(collected.uniform),
                    passed=float(collected.passed))
    record: dict[str, Any] = {
        "step": step, "reward_mean": sums["reward"] / sums["samples"], "accuracy": sums["correct"] / sums["samples"],
        "eval_accuracy": None, "response_length": sums["tokens"] / sums["samples"],
        "response_clip_ratio": sums["truncated"] / sums["batch"],
        "kl_predicted": None, "kl_actual": None, "alpha": None, "budget": None, "mismatch": c.controller.mismatch,
        "update_ratio": None, "lr": None, "logra_lr": None, "entropy": None, "ref_kl": None, "skipped": False,
        "skip_reason": None,
        "rollout_seconds": rollout_seconds,
        "sync_bytes": 0, "sync_mode": None, "sync_drift": 0, "sync_master_drift": 0.0,
        "rollout_tokens_per_second": sums["tokens"] / max(rollout_seconds, 1e-9), "train_tokens": 0,
        "train_positions": 0, "padding_share": None,
        "train_tokens_per_second": None, "prompts_skipped": int(sums["prompts_skipped"]),
        "resample_rounds": collected.extra_rounds, "groups_resampled": int(sums["resampled"]),
        "groups_uniform": int(sums["uniform"]), "advantage_std_raw": raw_std,
        "pass_at_group": sums["passed"] * rl.group_size / sums["batch"],  # slime's pass@n of the batch's groups
    }
    if len(c.task.names) > 1:  # a mixture: reward and accuracy per source too (the same decision on every rank)
        by_source = all_reduce_sum(collected.by_source_S3, groups.dp)
        record.update(source_fields(c.task.names, by_source, reward="reward_mean", accuracy="accuracy"))
    state.step = step
    if sums["batch_tokens"] == 0.0:  # every completion empty (an engine fault): nothing to train on
        refuse_update(state, step, "no completion token in the step", rl.max_bad_steps)
        record.update(skipped=True, skip_reason="no completion tokens", step_seconds=elapsed(t0, device),
                      **device_peaks(device))
        return record
    # with a KL penalty (entropy bonus) the step still pulls towards the reference (higher entropy)
    if sums["abs_advantage"] == 0.0 and rl.loss.kl_coef == 0 and rl.loss.entropy_coef == 0:
        logger.info("step %d: no completion token has a nonzero advantage (%s); no update", step,
                    zero_advantage_reason(rl))
        record.update(skipped=True, skip_reason="zero advantages", step_seconds=elapsed(t0, device),
                      **device_peaks(device))
        return record

    # ---- forward/backward
    ph.next("forward_backward")
    batch = pack_sequences(
        [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts],
        rollout_logprobs=[r.logprobs for r in rollouts], advantages=advantages.tolist(),
        finished=[r.finished for r in rollouts], pad_id=c.tokenizer.pad_token_id, max_length=cfg.model.seq_length,
        multiple=cfg.sequence_multiple(),
    )
    plan = step_plan(c, batch)  # the reference and the policy take the same micro-batches
    layout = _dp_sums(groups.dp, positions=float(sum(len(p.rows) * p.length for p in plan)),
                      # a row without a completion is packed as padding only (pack_sequences)
                      filled=float(sum(len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts
                                       if r.completion_ids)))
    record.update(train_positions=int(layout["positions"]), padding_share=1.0 - layout["filled"] / layout["positions"])
    if c.ref_model is not None:
        ref_logprobs = _reference_logprobs(c, batch, plan)
        if ref_logprobs is not None:  # only the last pipeline stage computes the loss
            batch.extras["ref_logprobs"] = ref_logprobs
    loss_fn = make_rl_loss_fn(rl.loss, rl.rollout.temperature, groups.tp)
    result, update, overflow_retries = backward_and_prepare(c, batch, loss_fn, step, ph, plan)
    gap_sum, gap_tokens = result.reports["mismatch"].tolist()
    entropy_sum, entropy_tokens = result.reports["entropy"].tolist()
    record["entropy"] = entropy_sum / entropy_tokens if entropy_tokens > 0 else None
    ref_kl_sum, ref_kl_tokens = result.reports["ref_kl"].tolist()
    record["ref_kl"] = ref_kl_sum / ref_kl_tokens if ref_kl_tokens > 0 else None

    # ---- prepare update (above, after the backward: a non-finite sketch or gradient skips the step, before
    # anything reads the forward; a float16 overflow re-ran the forward/backward at a smaller loss scale)
    record["train_tokens"] = result.global_tokens
    if getattr(update, "loss_scale", None) is not None:
        record.update(loss_scale=update.loss_scale, overflow_retries=overflow_retries)
    if update.skipped:
        refuse_update(state, step, update.reason or "non-finite sketch or gradient", rl.max_bad_steps)
        record.update(skipped=True, skip_reason=update.reason or "non-finite gradient", loss=None, entropy=None,
                      ref_kl=None, step_seconds=elapsed(t0, device), **device_peaks(device))
        return record
    step_lrs = getattr(c.optimizer, "step_lrs", None)  # a plugged-in optimizer (optimizer_factory) may lack it
    if step_lrs is not None:
        record.update(step_lrs(update))  # after optimizer.schedule; the step size α is recorded apart
    mismatch = c.controller.mismatch
    if gap_tokens > 0 and math.isfinite(gap_sum):
        mismatch = c.controller.observe_mismatch(gap_sum / gap_tokens)
    elif gap_tokens > 0:
        logger.warning("step %d: the rollout/trainer log-prob gap is not finite (%s); the mismatch estimate keeps "
                       "its last value", step, gap_sum)

    # ---- KL control (the budget schedule counts applied updates, not RL steps: skipped steps do not age it)
    ph.next("kl_control")
    update_number = c.controller.num_updates + 1
    alpha, budget, pred, old_logits, probe = 1.0, c.controller.effective_budget(update_number), None, None, None
    logra = isinstance(c.optimizer, LograOptimizer)
    ratio_at_1 = c.optimizer.relative_update_norm(update, 1.0) if logra else None  # ‖ΔW‖/‖W‖ scales with |α|
    if logra and cfg.kl.mode != "none":
        probe = _probe_batch(batch, cfg.kl, device)
        native = c.optimizer.native_deltas(update)  # the trained non-targets' part of the step (empty when frozen)
        with kl_errors_name_step(step):  # a non-finite prediction stops the run before anything is applied
            if probe_method(cfg.kl.probe, c.optimizer.sketches, groups.pp_size) == "jvp":
                pred, old_logits = predicted_kl(c.model, c.optimizer.sketches, update.directions, update.update_index,
                                                probe, groups, temperature=rl.rollout.temperature, native=native)
            else:
                h, h_native = fd_steps(cfg.kl, c.optimizer, ratio_at_1, native)
                pred, old_logits = predicted_kl_fd(c.model, c.optimizer.sketches, update.directions, probe, groups,
                                                   temperature=rl.rollout.temperature, step=h, native=native,
                                                   native_step=h_native)
            alpha, budget = c.controller.step_size(pred, update_number)
        del native
    elif cfg.kl.measure_actual:
        probe = _probe_batch(batch, cfg.kl, device)
        with torch.no_grad():
            old_logits = probe_logits(c.model, probe, groups)
    ratio = abs(alpha) * ratio_at_1 if logra else None

    # ---- apply (with sketch-delta sync, the very factors the engine will merge)
    ph.next("apply")
    factors = c.sync.factors(update, alpha)
    if factors is not None:
        c.optimizer.apply(update, alpha, factors=factors)
    else:
        c.optimizer.apply(update, alpha)
    actual = None
    if probe is not None and cfg.kl.measure_actual:  # old_logits live on the last pipeline stage only
        ph.next("kl_measure")
        actual = measure_kl(c.model, probe, old_logits, groups, temperature=rl.rollout.temperature)
        check_measured_kl(actual, step)
        c.controller.observe_actual(actual, alpha * alpha * pred if pred is not None else float("nan"))
    c.controller.finish_update()
    update_applied(state)

    # ---- sync
    ph.next("sync")
    state.weight_version += 1
    sync = c.sync.push(update, alpha, factors, state.weight_version - 1, state.weight_version)

    record.update(
        kl_predicted=(alpha * alpha * pred) if pred is not None else None, kl_actual=actual, alpha=alpha,
        # dense AdamW (RunConfig refuses kl.mode for it) and kl.mode=none are never KL-controlled: no budget
        budget=budget if logra and cfg.kl.mode != "none" else None,
        mismatch=mismatch, update_ratio=ratio, loss=result.loss, grad_norm=update.grad_norm,
        **sync, step_seconds=elapsed(t0, device), **device_peaks(device),
    )
    record["train_tokens_per_second"] = record["train_tokens"] / max(record["step_seconds"] - rollout_seconds, 1e-9)
    return record


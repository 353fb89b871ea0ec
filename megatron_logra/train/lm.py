"""LM training with LoGRA (or dense AdamW): the loop reads top to bottom.

batch → forward/backward (sketches accumulate) → prepare update (reduce, clip, RowAdam)
→ apply → log / evaluate / checkpoint.

Each step writes one record to ``RUN/metrics.jsonl`` (a non-finite value is ``null``) and the numeric
fields to TensorBoard (rank 0); counts are over the whole global batch (every DP rank):

* ``step`` — the optimizer step, from 1.
* ``loss`` — mean cross-entropy per answer token (the tokens the loss counts) of the step's batch, nats.
* ``grad_norm`` — global norm of the step's gradient before clipping (LoGRA: reconstructed from the
  sketches, plus the natively trained parameters' gradients); ``clip_coef`` — the factor clipping applied
  (1.0: none); ``skipped`` — the step was not applied (a non-finite gradient; a warning on rank 0 names the
  step).
* ``tokens`` — tokens processed: ``train.global_batch_size × (2·data.content_length + 1)`` input positions
  (the task's sequences are ``2·data.content_length + 2`` tokens),
  as Megatron-LM counts throughput (global batch × sequence length); ``tokens_per_second`` — ``tokens /
  step_seconds``.
* ``loss_tokens`` — the answer tokens the loss counts (``data.content_length`` per sequence), the
  denominator of ``loss``.
* ``lr`` / ``logra_lr`` — the learning rates the step was applied with, after ``optimizer.schedule``: the
  AdamW's (dense AdamW, or LoGRA's non-target parameters; ``null`` when they are frozen) and the LoGRA
  targets' (optimizer recipe; ``null`` otherwise); both ``null`` for a skipped step.
* ``step_seconds`` — wall time of the step: data, forward/backward, optimizer update (not the evaluation).
* ``gpu_memory_peak_bytes`` / ``gpu_memory_reserved_peak_bytes`` — the step's peak accelerator memory held
  by tensors / reserved by the caching allocator, the largest over all ranks
  (:func:`~megatron_logra.metrics.device_peaks`); ``null`` off CUDA.
* ``eval_loss`` — held-out loss per answer token (:func:`~megatron_logra.train.lm_eval.evaluate`) on steps
  that are multiples of ``train.eval_interval``, else ``null``.

The log line every ``train.log_interval`` steps shows ``loss``, ``grad_norm``, ``step_seconds`` and
``tokens_per_second`` (and the GPU memory peak).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import yaml

from megatron_logra.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_logra.checkpoint.integrity import atomic_write_text
from megatron_logra.checkpoint.run_dir import check_resume_steps, claim_run_dir, releasing_run_dir
from megatron_logra.config import RunConfig, to_dict
from megatron_logra.data.synthetic import SyntheticTask
from megatron_logra.memory.preflight import memory_preflight
from megatron_logra.metrics import (MetricsWriter, closing_metrics_on_error, device_peaks, elapsed, is_rank0,
                                    reset_device_peaks, strict_dumps)
from megatron_logra.models.gpt import build_gpt
from megatron_logra.optim import LograOptimizer, build_optimizer
from megatron_logra.parallel import initialize_parallel
from megatron_logra.profiling import Phases, job_profiler
from megatron_logra.run_summary import previous_summary_values, record_before_values
from megatron_logra.rollout.sglang_setup import redact_config
from megatron_logra.train.lm_checks import check_config, num_microbatches
from megatron_logra.train.lm_eval import evaluate, warn_deprecated_eval_batches
from megatron_logra.train.lm_progress import recorded_losses, run_summary, start_progress
from megatron_logra.train.step import forward_backward, model_device
from megatron_logra.train.stopping import EarlyStop
from megatron_logra.wandb_log import wandb_options

logger = logging.getLogger(__name__)

__all__ = ["run_lm", "check_config"]


@releasing_run_dir
@closing_metrics_on_error
def run_lm(cfg: RunConfig) -> dict:
    """Train ``cfg`` and return the run's summary (:func:`~megatron_logra.train.lm_progress.run_summary` lists
    its fields: the whole run, also after ``--resume``), also written to ``RUN/summary.json`` as strict JSON: a
    loss that is not finite (a diverged or overflowed run) is None / ``null`` there and in the returned dict, as
    in ``metrics.jsonl``. ``RUN/config.yaml`` and ``summary.json`` are replaced atomically (a crash leaves the
    old file or the new one).

    Every check that can refuse the run (the batch layout over the DP ranks, the data, the model and
    optimizer build) runs before ``train.overwrite=true`` deletes a previous run's outputs, so a refused
    launch leaves them in place. Resuming (``train.resume``) with ``train.steps`` below the latest
    checkpoint's step raises ValueError naming ``train.steps`` before anything is written.
    The last step's checkpoint is saved before the final evaluation. A run stopped early (``train.exit_signal_handler``,
    ``train.exit_duration_minutes``) saves the checkpoint of its last step, skips the final evaluation
    and names the reason in ``summary["stopped"]``; the conditions stay in force through the final save
    and evaluation (a stop asked for during the save skips the evaluation, one during the evaluation
    lets it finish), so the job still ends normally."""
    job_start = time.monotonic()
    groups = initialize_parallel(cfg.parallel, seed=cfg.train.seed)
    # every check that can refuse the run comes before train.overwrite deletes the previous run's outputs
    num_micro = num_microbatches(cfg, groups)
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    if is_rank0():
        warn_deprecated_eval_batches(cfg)
    memory_preflight(cfg, tp=groups.tp_size, pp=groups.pp_size, dp=groups.dp_size)  # on a GPU: fits? (before building)
    profiler = job_profiler(cfg.profile, cfg.train.run_dir)
    if not cfg.train.overwrite:  # refusing a run_dir that holds a run deletes nothing: before the (slow) build
        claim_run_dir(cfg.train.run_dir, resume=cfg.train.resume, overwrite=False)
    if cfg.train.resume:
        check_resume_steps(cfg.train.run_dir, cfg.train.steps, "train.steps")
    model = build_gpt(cfg.model, groups, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optimizer, groups, total_steps=cfg.train.steps)
    if cfg.train.overwrite:  # deletes the previous run: only once the layout, model and optimizer are known to work
        claim_run_dir(cfg.train.run_dir, resume=cfg.train.resume, overwrite=True)
    run_dir = Path(cfg.train.run_dir)

    start = 0
    if cfg.train.resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            start = load_checkpoint(ckpt, model, optimizer, groups, checksums=cfg.train.checkpoint_checksums,
                                    model_config=cfg.model)["step"]
            logger.info("resuming from %s at step %d", ckpt, start)
    # the steps of earlier processes, before this one's MetricsWriter drops the records past the checkpoint
    recorded = recorded_losses(run_dir / "metrics.jsonl", (1, start)) if start else {}
    eval_before_run = (previous_summary_values(run_dir / "summary.json", start, ("eval_loss_before",))
                       .get("eval_loss_before") if start else None)
    saved_config = redact_config(to_dict(cfg))  # what config.yaml and the checkpoints hold: no credentials
    if is_rank0():
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(saved_config, sort_keys=False))
    metrics = MetricsWriter(run_dir, truncate_after=start if cfg.train.resume else None,
                            wandb=wandb_options(cfg.train, saved_config))

    eval_before = evaluate(model, task, cfg, groups, optimizer)
    if not start:
        eval_before_run = eval_before
        # kept at once: a run killed before its summary.json still reports it when resumed
        record_before_values(run_dir, {"eval_loss_before": eval_before})
        metrics.write_before({"eval_loss": eval_before})
    first_loss: Optional[float] = recorded.get(1)
    last_loss: Optional[float] = recorded.get(start)
    progress = start_progress(cfg, start) if cfg.train.progress and is_rank0() else None
    t_start = time.perf_counter()
    device = model_device(model)
    stop = EarlyStop(signal_handler=cfg.train.exit_signal_handler, duration_minutes=cfg.train.exit_duration_minutes,
                     start=job_start)
    stopped: Optional[str] = None
    last, saved = start, start
    # the handler stays installed until the summary is written: a SIGTERM during the final save or
    # evaluation is caught too, and the last step's checkpoint is saved before that evaluation
    with stop:
        for step in range(start + 1, cfg.train.steps + 1):
            reset_device_peaks(device)
            t0 = time.perf_counter()
            with profiler.step(step):
                with Phases("lm") as ph:
                    ph.next("data")
                    microbatches = [task.microbatch(step, groups.dp_rank * num_micro + i, cfg.train.micro_batch_size)
                                    for i in range(num_micro)]
                    ph.next("forward_backward")
                    optimizer.zero_grad()
                    result = forward_backward(model, microbatches, groups, grad_scale=optimizer.loss_scale)
                    ph.next("prepare")
                    update = optimizer.prepare(num_tokens=result.num_tokens)
                    ph.next("apply")
                    optimizer.apply(update)
                # before the window's last step closes it: writing the trace is not the step's time
                step_seconds = elapsed(t0, device)
            if update.skipped and not update.overflow and is_rank0() and not isinstance(optimizer, LograOptimizer):
                # (LoGRA warns itself; a float16 overflow is routine: the loss scale comes down)
                logger.warning("step %d skipped (%s): its update was not applied (metrics.jsonl: \"skipped\": true); "
                               "a run that keeps skipping has diverged: lower the lr (--lr)",
                               step, update.reason or "non-finite gradient")

            # every rank's micro-batches have the same shape: the global batch × its input positions
            processed = cfg.train.global_batch_size * microbatches[0].tokens.shape[1]
            last_loss = result.loss
            if step == 1:
                first_loss = result.loss
            record = {
                "step": step,
                "loss": result.loss,
                "grad_norm": update.grad_norm,
                "clip_coef": update.clip_coef,
                "skipped": update.skipped,
                **({"skip_reason": update.reason or "non-finite gradient"} if update.skipped else {}),
                **optimizer.step_lrs(update),
                **({"loss_scale": update.loss_scale} if update.loss_scale is not None else {}),
                "tokens": processed,
                "tokens_per_second": processed / max(step_seconds, 1e-9),
                "loss_tokens": result.global_tokens,
                "step_seconds": step_seconds,
                **device_peaks(device),
                "eval_loss": None,
            }
            if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
                record["eval_loss"] = evaluate(model, task, cfg, groups, optimizer)
            metrics.write(record)
            if progress is not None:
                progress[0].update(progress[1], advance=1, loss=result.loss, gnorm=update.grad_norm)
            if is_rank0() and (step % cfg.train.log_interval == 0 or step == cfg.train.steps):
                memory = record["gpu_memory_peak_bytes"]
                logger.info("step %d loss %.4f grad_norm %.3f %.3fs/step %.0f tokens/s%s", step, result.loss,
                            update.grad_norm, step_seconds, record["tokens_per_second"],
                            "" if memory is None else f" peak {memory / 2**30:.2f} GiB")
            last = step
            if cfg.train.save_interval and step % cfg.train.save_interval == 0 and step != cfg.train.steps:
                metrics.sync()  # the records up to the checkpoint are on storage before it
                save_checkpoint(run_dir, step, model, optimizer, groups, config=saved_config,
                                keep_last=cfg.train.keep_last, checksums=cfg.train.checkpoint_checksums)
                saved = step
            stopped = stop.check()
            if stopped is not None:
                logger.warning("stopping after step %d (%s); continue with --resume %s", step, stopped, run_dir)
                break
        if progress is not None:
            progress[0].stop()
        profiler.close()  # a window the run left early (a stop) writes what it recorded
        train_seconds = time.perf_counter() - t_start
        if last > saved:  # the last step's checkpoint, before the final evaluation (not again if already saved)
            metrics.sync()  # the records up to the checkpoint are on storage before it
            save_checkpoint(run_dir, last, model, optimizer, groups, config=saved_config,
                            keep_last=cfg.train.keep_last, checksums=cfg.train.checkpoint_checksums)
        if stopped is None:  # a stop asked for during that save: no final evaluation
            stopped = stop.check_after_training("the final save")
        eval_after = None
        if stopped is None:
            eval_after = evaluate(model, task, cfg, groups, optimizer)
            stopped = stop.check_after_training("the final evaluation")
        summary = run_summary(cfg, first_loss=first_loss, last_loss=last_loss, eval_before_run=eval_before_run,
                              eval_after=eval_after, steps=last, stopped=stopped, start=start,
                              eval_before=eval_before, train_seconds=train_seconds)
        if is_rank0():
            atomic_write_text(run_dir / "summary.json", strict_dumps(summary, indent=1))
        metrics.close(summary)
        if is_rank0():
            logger.info("done: %s", summary)
    return summary


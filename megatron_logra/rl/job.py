"""The RL job: build everything, warm start, then run ``rl_update`` step after step.

The parts: :mod:`~megatron_logra.rl.warm_start` (the run's tokenizer and the policy's warm start),
:mod:`~megatron_logra.rl.components` (the start-time checks and everything the loop works on),
:mod:`~megatron_logra.rl.progress` (summary and progress helpers) and :func:`run_rl` here, which drives the
loop and writes the run's files.

Owns the run directory: ``config.yaml``, ``tokenizer/``, ``metrics.jsonl``, TensorBoard
events, ``checkpoints/`` and ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import yaml

from megatron_logra.checkpoint import latest_checkpoint, save_checkpoint
from megatron_logra.checkpoint.integrity import atomic_write_text
from megatron_logra.checkpoint.run_dir import releasing_run_dir
from megatron_logra.config import RunConfig, to_dict
from megatron_logra.metrics import (SAMPLES_FILE, MetricsWriter, closing_metrics_on_error, is_rank0, keep_records_until,
                                    strict_dumps)
from megatron_logra.profiling import job_profiler
from megatron_logra.rewards.process_pool import closing_reward_workers
from megatron_logra.run_summary import record_before_values
from megatron_logra.rl.components import build_components, check_config
from megatron_logra.rl.evaluation import evaluate_held_out, no_held_out_reason
from megatron_logra.rl.loop import rl_update
from megatron_logra.rl.progress import bar_fields, previous_summary, progress_bar, rss_bytes, run_total
from megatron_logra.rl.sample_log import SampleLog
from megatron_logra.rollout.sglang_setup import redact_config
from megatron_logra.train.stopping import EarlyStop
from megatron_logra.wandb_log import wandb_options

logger = logging.getLogger(__name__)

__all__ = ["run_rl", "build_components", "check_config"]  # the last two for the CLI, which imports them here


_LOGGED = ("reward_mean", "accuracy", "alpha", "kl_predicted", "kl_actual", "step_seconds", "rollout_tokens_per_second",
           "train_tokens_per_second", "gpu_memory_peak_bytes")
"""Record fields of the rank-0 log line every ``train.log_interval`` updates (without a progress bar)."""


def _summary_name(field: str, when: str) -> str:
    """The summary's name of a held-out field measured ``when`` (``"before"`` update 1 or ``"after"`` the last):
    ``eval_accuracy/gcd`` → ``eval_accuracy_after/gcd``, ``eval_pass_at_k`` → ``eval_pass_at_k_after``."""
    if field.startswith("eval_accuracy/"):
        return field.replace("eval_accuracy/", f"eval_accuracy_{when}/", 1)
    return f"{field}_{when}"


@releasing_run_dir
@closing_metrics_on_error
@closing_reward_workers
def run_rl(cfg: RunConfig, optimizer_factory=None) -> dict:
    """Warm start + RL; returns the summary, also written to ``RUN/summary.json`` as strict JSON (a value
    that was not measured, e.g. held-out accuracy with ``task.num_eval=0``, is ``null``).
    ``optimizer_factory``: see ``build_components``. The configs it saves (``RUN/config.yaml``, each
    checkpoint's) never hold ``rl.rollout.sglang_api_key`` (``rollout.sglang_setup.redact_config``);
    ``config.yaml`` and ``summary.json`` are replaced atomically (a crash leaves the old file or the new one).

    The summary describes the whole run, also after ``--resume`` (what earlier processes did is carried
    over from the previous ``summary.json``), as the language-model job's does:

    * ``steps`` — the run's last RL update (whichever process made it).
    * ``eval_accuracy_before`` — held-out accuracy before update 1: measured by a run that starts at step 0,
      carried over from the previous ``summary.json`` by a resumed one, or from ``RUN/eval_before.json``, which
      the run that started at step 0 writes as soon as it has measured it (None when neither has it); for a
      task mixture or held-out benchmarks also ``eval_accuracy_before/SOURCE`` per source (kept the same way).
      ``eval_accuracy_after`` — held-out accuracy after update ``steps`` (None for a run stopped early); for a
      task mixture also ``eval_accuracy_after/SOURCE`` per source (:mod:`megatron_logra.rl.source_metrics`).
    * ``setup_seconds`` / ``rl_seconds`` / ``total_seconds`` — the sums of the processes' ``segment_*``
      times over the run; None when an earlier process's are unknown (the previous ``summary.json`` is
      missing or does not end at the step this process resumed from, e.g. that process was killed).
    * ``stopped`` — why this process stopped early (None: it reached ``rl.steps``).
    * This process only: ``resumed_from_step`` (the checkpoint's step it started from, 0 for a new run),
      ``segment_steps`` (the updates it made, ``steps - resumed_from_step``),
      ``segment_eval_accuracy_before`` (held-out accuracy at ``resumed_from_step``), ``segment_setup_seconds``
      (building, warm start, resume), ``segment_rl_seconds`` (from its first update to the end of the final
      evaluation) and ``segment_total_seconds``.

    A resume with ``rl.steps`` equal to the latest checkpoint's step trains nothing and writes the same
    whole-run summary again (``segment_steps`` 0).

    The last step's checkpoint is saved before the final held-out evaluation, with the early-stop
    conditions (``train.exit_signal_handler``, ``train.exit_duration_minutes``) still in force: a stop
    asked for during that save skips the evaluation, one during the evaluation lets it finish; either
    way the job ends normally with ``summary["stopped"]`` naming why."""
    t_start, job_start = time.perf_counter(), time.monotonic()
    comps, state, bundle = build_components(cfg, optimizer_factory)
    run_dir = Path(cfg.train.run_dir)
    profiler = job_profiler(cfg.profile, run_dir)
    saved_config = redact_config(to_dict(cfg))  # what config.yaml and the checkpoints hold: no credentials
    if is_rank0():
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(saved_config, sort_keys=False))
    start_step = state.step
    # what earlier processes of the run did, read before this one's summary replaces theirs
    previous = previous_summary(run_dir / "summary.json", start_step) if start_step else {}
    metrics = MetricsWriter(run_dir, truncate_after=state.step if cfg.train.resume else None,
                            wandb=wandb_options(cfg.train, saved_config))
    setup_seconds = time.perf_counter() - t_start
    if cfg.rl.log_samples:
        comps.sample_log = SampleLog(run_dir, cfg.rl.log_samples, truncate_after=state.step if cfg.train.resume else None,
                                     table=metrics.log_table)
    elif cfg.train.resume and is_rank0():  # logging now off: an earlier process's records still end at the checkpoint
        keep_records_until(run_dir / SAMPLES_FILE, state.step)

    def sync_logs() -> None:
        """The records up to a checkpoint are on storage before it is."""
        metrics.sync()
        if comps.sample_log is not None:
            comps.sample_log.sync()

    # a resumed run's evaluation at its checkpoint's step is in the sample log already (when that step had one)
    eval_before, before_by_source = evaluate_held_out(comps, None if start_step else 0)
    before_named = {_summary_name(k, "before"): v for k, v in before_by_source.items()}  # summary / eval_before.json
    if eval_before is None:
        level, why = no_held_out_reason(cfg, comps.task)
        logger.log(level, "no held-out evaluation (%s): eval_accuracy is null in metrics.jsonl and summary.json", why)
    elif start_step:
        logger.info("held-out accuracy at RL step %d (resumed): %.3f", start_step, eval_before)
    else:
        logger.info("held-out accuracy before RL: %.3f", eval_before)
    if not start_step:  # kept at once: a run killed before its summary.json still reports it when resumed
        record_before_values(run_dir, {"eval_accuracy_before": eval_before, **before_named})
        metrics.write_before({"eval_accuracy": eval_before, **before_by_source})
    progress = progress_bar(cfg, state.step) if cfg.train.progress and is_rank0() else None
    record = {}
    if start_step >= cfg.rl.steps:
        logger.info("the run is at RL step %d >= rl.steps=%d: nothing to train (raise rl.steps to continue)",
                    start_step, cfg.rl.steps)
    rl_start = time.perf_counter()
    stopped: Optional[str] = None
    saved = start_step if latest_checkpoint(run_dir) is not None else -1
    # the handler stays installed until the summary is written: a SIGTERM during the final save or
    # evaluation is caught too, and the last step's checkpoint is saved before that evaluation
    with EarlyStop(signal_handler=cfg.train.exit_signal_handler, duration_minutes=cfg.train.exit_duration_minutes,
                   start=job_start) as stop:
        while state.step < cfg.rl.steps:
            with profiler.step(state.step + 1):
                record = rl_update(comps, state)
            if cfg.rl.eval_interval and (state.step % cfg.rl.eval_interval == 0 or state.step == cfg.rl.steps):
                record["eval_accuracy"], by_source = evaluate_held_out(comps, state.step)
                record.update(by_source)
            record["memory_bytes"] = rss_bytes()
            metrics.write(record)
            if progress is not None:
                progress[0].update(progress[1], advance=1, **bar_fields(record))
            elif is_rank0() and state.step % cfg.train.log_interval == 0:
                logger.info("rl step %d %s", state.step,
                            {k: record.get(k) for k in _LOGGED if record.get(k) is not None})
            if cfg.train.save_interval and state.step % cfg.train.save_interval == 0 and state.step != cfg.rl.steps:
                sync_logs()
                save_checkpoint(run_dir, state.step, comps.model, bundle, comps.groups, config=saved_config,
                                keep_last=cfg.train.keep_last, checksums=cfg.train.checkpoint_checksums)
                saved = state.step
            stopped = stop.check()
            if stopped is not None:
                logger.warning("stopping after RL step %d (%s); continue with --resume %s", state.step, stopped,
                               run_dir)
                break
        if progress is not None:
            progress[0].stop()
        profiler.close()  # a window the run left early (a stop) writes what it recorded
        if state.step > saved:  # the last step's checkpoint, before the final evaluation (not again if already saved)
            sync_logs()
            save_checkpoint(run_dir, state.step, comps.model, bundle, comps.groups, config=saved_config,
                            keep_last=cfg.train.keep_last, checksums=cfg.train.checkpoint_checksums)
        if stopped is None:  # a stop asked for during that save: no final evaluation
            stopped = stop.check_after_training("the final save")
        after_by_source: dict = {}
        if stopped is not None:
            eval_after = None
        elif record.get("eval_accuracy") is not None:
            eval_after = record["eval_accuracy"]
            after_by_source = {k: v for k, v in record.items() if k.startswith("eval_accuracy/") or k == "eval_pass_at_k"}
        elif state.step == start_step:  # nothing trained: the policy evaluated before the loop
            eval_after, after_by_source = eval_before, before_by_source
        else:
            eval_after, after_by_source = evaluate_held_out(comps, state.step)
            stopped = stop.check_after_training("the final evaluation")
        rl_seconds, total_seconds = time.perf_counter() - rl_start, time.perf_counter() - t_start
        eval_before_run = previous.get("eval_accuracy_before") if start_step else eval_before
        before_by_source_run = ({k: v for k, v in previous.items() if k.startswith(("eval_accuracy_before/",
                                                                                     "eval_pass_at_k_before"))}
                                if start_step else before_named)
        summary = {
            "optimizer": cfg.optimizer.name, "task": cfg.task.datasets, "steps": state.step,
            **({"eval_datasets": cfg.task.eval_datasets} if cfg.task.eval_datasets else {}),
            "eval_accuracy_before": eval_before_run, "eval_accuracy_after": eval_after,
            "setup_seconds": run_total(previous, "setup_seconds", setup_seconds, start_step),
            "rl_seconds": run_total(previous, "rl_seconds", rl_seconds, start_step),
            "total_seconds": run_total(previous, "total_seconds", total_seconds, start_step),
            "run_dir": str(run_dir), "stopped": stopped,
            "resumed_from_step": start_step, "segment_steps": state.step - start_step,
            "segment_eval_accuracy_before": eval_before, "segment_setup_seconds": setup_seconds,
            "segment_rl_seconds": rl_seconds, "segment_total_seconds": total_seconds,
            # a mixture: the held-out accuracy per source before and after ("eval_accuracy_after/gcd"); pass@k
            **before_by_source_run,
            **{_summary_name(k, "after"): v for k, v in after_by_source.items()},
        }
        if is_rank0():
            atomic_write_text(run_dir / "summary.json", strict_dumps(summary, indent=1))
        metrics.close(summary)
        if is_rank0():
            if stopped is None and eval_before_run is not None and eval_after is not None:
                resumed = (f" ({eval_before:.3f} at step {start_step}, where this process resumed)"
                           if start_step and eval_before is not None else "")
                logger.info("done: held-out accuracy %.3f -> %.3f%s", eval_before_run, eval_after, resumed)
            elif stopped is None and eval_before is not None and eval_after is not None:
                logger.info("done: held-out accuracy %.3f at step %d (where this process resumed; the run's "
                            "accuracy before step 1 is unknown) -> %.3f", eval_before, start_step, eval_after)
            elif stopped is None:
                logger.info("done (no held-out evaluation)")
    return summary

"""The RL job: build everything, warm start, then run ``rl_update`` step after step.

Owns the run directory: ``config.yaml``, ``tokenizer/``, ``metrics.jsonl``, TensorBoard
events, ``checkpoints/`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Optional

import yaml

from megatron_logra.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_logra.checkpoint.integrity import atomic_write_text
from megatron_logra.checkpoint.run_dir import check_resume_steps, claim_run_dir, releasing_run_dir
from megatron_logra.config import RunConfig, to_dict
from megatron_logra.data.tokenizer import (
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
    stop_token_ids,
)
from megatron_logra.kl.controller import KLController
from megatron_logra.kl.probe import probe_method
from megatron_logra.memory.preflight import memory_preflight
from megatron_logra.metrics import MetricsWriter, is_rank0, previous_summary_values, record_before_values, strict_dumps
from megatron_logra.models.gpt import build_gpt
from megatron_logra.optim import LograOptimizer, build_optimizer
from megatron_logra.parallel import ParallelGroups, initialize_parallel, world_group
from megatron_logra.rollout.driver import share_from_driver
from megatron_logra.rollout.sglang_engine import check_engine_dtype
from megatron_logra.rollout.sglang_setup import redact_config
from megatron_logra.rewards import build_task
from megatron_logra.rl.config import check_rl_batch_layout
from megatron_logra.rl.loop import (
    RLComponents,
    RLState,
    check_prompt_fits,
    evaluate_accuracy,
    rl_prompt_ids,
    rl_update,
)
from megatron_logra.rl.sft import load_weights, run_sft, save_weights, warm_start_key
from megatron_logra.convert.load import load_hf_into_model
from megatron_logra.convert.spec import model_config_from_hf
from megatron_logra.rl.policy_sync import PolicySync
from megatron_logra.rl.teachers import build_teacher
from megatron_logra.rollout import build_engine
from megatron_logra.train.stopping import EarlyStop

logger = logging.getLogger(__name__)

__all__ = ["run_rl", "build_components", "check_config", "check_native_step_control"]


class _OptimizerWithRL:
    """Checkpoint adapter: optimizer + KL controller + RL loop state as one sharded state."""

    def __init__(self, optimizer, controller: KLController, state: RLState) -> None:
        self.optimizer, self.controller, self.state = optimizer, controller, state

    def sharded_state(self):
        scalars, slots = self.optimizer.sharded_state()
        return {"optimizer": scalars, "kl": self.controller.state_dict(), "rl": self.state.state_dict()}, slots

    def load_sharded_state(self, scalars: dict, slots) -> None:
        self.optimizer.load_sharded_state(scalars["optimizer"], slots)
        self.controller.load_state_dict(scalars["kl"])
        self.state.load_state_dict(scalars["rl"])


def _tokenizer(cfg: RunConfig, task, run_dir: Path, *, will_save: bool):
    """The run's tokenizer: a resumed run's ``RUN/tokenizer``; else ``tokenizer.path``'s, else (with
    ``model.hf_path``) the checkpoint's, else one built for the task. Nothing is written here: the caller
    saves it (:func:`_save_tokenizer`) once the run directory is claimed, unless ``will_save`` is false
    (evaluation never writes into the run directory). A resumed run whose ``RUN/tokenizer`` is
    missing gets one from the config as above, with a warning naming the missing directory and the source used
    (it is the run's tokenizer only if that source is unchanged since the run started).
    A tokenizer with more tokens than ``model.vocab_size`` rows is a ValueError naming both, before it is saved."""
    saved = run_dir / "tokenizer"
    if cfg.train.resume and saved.exists():
        tok, source = load_tokenizer(saved), f"the run's saved tokenizer {saved}"
    else:
        if cfg.model.hf_path and not cfg.tokenizer.path:  # a real checkpoint brings its tokenizer
            tok = load_tokenizer(cfg.model.hf_path)
            source = f"the tokenizer of model.hf_path={cfg.model.hf_path!r}"
        else:
            texts = [task.train_problem(i).prompt + " " + task.train_problem(i).answer for i in range(64)]
            tok = build_tokenizer(cfg.tokenizer, texts)
            source = (f"tokenizer.path={cfg.tokenizer.path!r}" if cfg.tokenizer.path
                      else f"the {cfg.tokenizer.kind} tokenizer built for the task (tokenizer.path empty)")
        if cfg.train.resume and is_rank0():
            logger.warning("%s is missing: using %s instead, which is the run's tokenizer only if it has not "
                           "changed since the run started (restore %s to use the run's own)%s", saved, source, saved,
                           "" if will_save else "; not saved into the run directory")
    if len(tok) > cfg.model.vocab_size:
        fix = ("give a tokenizer made for this checkpoint (tokenizer.path=, empty, takes model.hf_path's own)"
               if cfg.model.hf_path else "raise model.vocab_size or give a smaller tokenizer")
        raise ValueError(f"{source} has {len(tok)} tokens but model.vocab_size={cfg.model.vocab_size} (the model's "
                         f"embedding rows): token ids past it have no embedding; {fix}")
    return tok


def _save_tokenizer(cfg: RunConfig, tok, run_dir: Path) -> None:
    """``tok`` into ``RUN/tokenizer`` (rank 0), unless a resumed run already has it there."""
    saved = run_dir / "tokenizer"
    if is_rank0() and not (cfg.train.resume and saved.exists()):
        save_tokenizer(tok, saved)


def _warm_start(cfg: RunConfig, model, groups: ParallelGroups, task, tok) -> None:
    if cfg.model.hf_path:
        stats = load_hf_into_model(model, groups, cfg.model.hf_path, cfg.model)
        logger.info("started from %s (%d tensors, %.1fs); no supervised warm start", cfg.model.hf_path,
                    stats["tensors"], stats["seconds"])
        return
    if cfg.sft.init_path:
        try:
            load_weights(model, groups, Path(cfg.sft.init_path))
        except ValueError as exc:
            raise ValueError(f"sft.init_path={cfg.sft.init_path!r} does not load into this model: {exc}. A warm start "
                             f"fits only the model config it was made for; set sft.init_path= (empty) to train one "
                             f"for this model, or make one with tools/make_warm_start.py") from exc
        return
    if cfg.sft.steps == 0:
        logger.warning("no model.hf_path, sft.init_path or supervised warm start (sft.steps=0): "
                       "RL starts from random weights")
        return
    key = warm_start_key({"model": to_dict(cfg.model), "task": to_dict(cfg.task), "sft": to_dict(cfg.sft),
                         "template": cfg.rl.prompt_template, "seed": cfg.train.seed,
                         **({"chat_template": True} if cfg.rl.chat_template else {}),
                         "vocab": tok.get_vocab() if hasattr(tok, "get_vocab") else None})
    cache = Path(cfg.train.run_dir).parent / ".cache" / f"warm_start_{key}.safetensors"
    # one decision for all ranks: a cache another job has just written may not be visible everywhere yet,
    # and ranks that disagreed would run different collectives (the warm start's vs none)
    if cfg.sft.cache and share_from_driver(cache.exists, world_group()):
        logger.info("warm start: reusing %s", cache)
        load_weights(model, groups, cache)
        return

    teacher = build_teacher(cfg.sft.teacher, cfg.sft.teacher_kwargs)

    def demo(index: int):
        problem = task.train_problem(1_000_000_000 + index)  # disjoint from the RL stream's indices
        prompt = rl_prompt_ids(tok, cfg.rl, problem.prompt)
        answer = tok(teacher(problem, index), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return prompt, answer

    t0 = time.perf_counter()

    def log(step: int, loss: float) -> None:
        if is_rank0() and (step % 50 == 0 or step == cfg.sft.steps):
            logger.info("warm start step %d/%d loss %.4f", step, cfg.sft.steps, loss)

    loss = run_sft(model, groups, demo, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                   micro_batch_size=cfg.rl.micro_batch_size, pad_id=tok.pad_token_id,
                   max_length=cfg.model.seq_length, multiple=cfg.sequence_multiple(),
                   log=log, final_lr_ratio=cfg.sft.final_lr_ratio)
    logger.info("warm start done in %.0fs (loss %.4f)", time.perf_counter() - t0, loss)
    if cfg.sft.cache:
        save_weights(model, groups, cache, meta={"sft_loss": loss, "key": key})


def check_native_step_control(cfg: RunConfig) -> None:
    """Refuse a KL-controlled LoGRA run whose trained non-target parameters (``optimizer.native.freeze=false``)
    take their AdamW step in full whatever the step size α (``optimizer.logra.scale_native=false``): the KL
    of such a step is not quadratic in α, so no prediction can bound it."""
    opt = cfg.optimizer
    if opt.name == "logra" and not opt.native.freeze and not opt.logra.scale_native and cfg.kl.mode != "none":
        raise ValueError(
            f"optimizer.logra.scale_native=false with trained non-target parameters (optimizer.native.freeze=false) "
            f"and kl.mode={cfg.kl.mode}: the native AdamW step would not scale with the step size α, so the "
            "predicted-KL controller cannot bound the update; set optimizer.logra.scale_native=true, "
            "optimizer.native.freeze=true or kl.mode=none")


def _check_settings(cfg: RunConfig, *, native_step_control: bool = True) -> None:
    """The checks of the config alone that the job runs first: the native step's control
    (:func:`check_native_step_control`, unless a benchmark's optimizer replaces the trainer's), ``model.hf_path``'s
    architecture (it replaces ``cfg.model``; reads ``config.json`` only) and an in-process SGLang engine's dtype."""
    if native_step_control:
        check_native_step_control(cfg)
    if cfg.model.hf_path:  # the checkpoint's architecture replaces the recipe's
        cfg.model = model_config_from_hf(cfg.model.hf_path, base=cfg.model)
    if cfg.rl.rollout.engine == "sglang" and not cfg.rl.rollout.sglang_url:
        check_engine_dtype(cfg.model.params_dtype)  # an in-process engine: refused before anything is loaded


def _task_and_tokenizer(cfg: RunConfig, run_dir: Path, *, will_save: bool) -> tuple:
    """``(task, tokenizer, stop token ids)`` of the run, checked before any model is built: the task
    (:func:`~megatron_logra.rewards.build_task`: dataset names and kwargs, JSONL files, the reward plugin), the
    tokenizer (:func:`_tokenizer`: ``tokenizer.path`` or ``model.hf_path``'s tokenizer files, its size against
    ``model.vocab_size``), ``rl.chat_template``, the longest prompt against ``model.seq_length`` and the stop
    tokens (``generation_config.json``). Nothing is written."""
    task = build_task(cfg.task)
    tok = _tokenizer(cfg, task, run_dir, will_save=will_save)
    if cfg.rl.chat_template:  # refuse a tokenizer without a chat template before building anything
        rl_prompt_ids(tok, cfg.rl, "check")
    # the same on every rank: a long prompt fails here, not mid-run; the longest one, so that the fix the
    # error suggests fits every held-out prompt, and every prompt of a file (JSONL) source held in memory
    prompts = [problem.prompt for problem in task.eval_problems()]
    prompts += [problem.prompt for source in task.sources for problem in getattr(source, "problems", ())]
    lengths = [(len(rl_prompt_ids(tok, cfg.rl, prompt)), prompt) for prompt in prompts]
    if lengths:
        check_prompt_fits(cfg, *max(lengths, key=lambda item: item[0]))
    return task, tok, stop_token_ids(tok, cfg.model.hf_path, cfg.tokenizer.path)


def check_config(cfg: RunConfig) -> None:
    """The start-time checks of the RL job that need no process group, model or GPU and write nothing, as
    ``megatron-logra config`` runs them (``cfg`` is changed as the job changes it: take a copy to keep it):
    :func:`_check_settings`, a resumed run's ``rl.steps`` against its latest checkpoint, and
    :func:`_task_and_tokenizer`. What they refuse, the job refuses with the same error. Not checked here: the
    batch layout over the launch's DP / PP ranks, SGLang's presence, the memory plan, ``train.run_dir``'s
    state, the model build, the weights and the KL probe."""
    _check_settings(cfg)
    if cfg.train.resume:
        check_resume_steps(cfg.train.run_dir, cfg.rl.steps, "rl.steps")
    _task_and_tokenizer(cfg, Path(cfg.train.run_dir), will_save=False)


def build_components(cfg: RunConfig, optimizer_factory=None, *,
                     for_eval: bool = False) -> tuple[RLComponents, RLState, _OptimizerWithRL]:
    """Everything the loop needs, warm-started (and resumed when asked).

    ``optimizer_factory(model, cfg.optimizer, groups)``, when given, replaces ``build_optimizer``
    (benchmarks plug in other optimizers with the ``DenseAdamW`` interface this way).

    ``for_eval``: what held-out evaluation (``megatron-logra eval``) reads: no reference model for
    ``rl.loss.kl_coef`` (``ref_model`` is None: neither built nor warm-started), and nothing the run wrote
    is changed: a missing ``RUN/tokenizer`` is rebuilt from the config with a warning, not saved, and the
    engine is synced in process whatever ``sync.transport`` says (a directory transport would prune the
    run's delta files and write anchors). An in-process SGLang engine still writes its scratch model
    config under ``RUN/sglang_model``."""
    _check_settings(cfg, native_step_control=optimizer_factory is None)
    if cfg.rl.rollout.engine == "sglang" and not cfg.rl.rollout.sglang_url:
        from megatron_logra.rollout.sglang_api import require_sglang

        try:  # a user error before the (minutes-long) build, not an ImportError once the model is loaded
            require_sglang()
        except ImportError as exc:
            raise ValueError(str(exc)) from None
    groups = initialize_parallel(cfg.parallel, seed=cfg.train.seed)
    check_rl_batch_layout(cfg, groups.dp_size, groups.pp_size)  # every rank, before anything is built
    memory_preflight(cfg, tp=groups.tp_size, pp=groups.pp_size, dp=groups.dp_size)  # on a GPU: fits? (before building)
    run_dir = Path(cfg.train.run_dir)
    # every check that can refuse the run comes before train.overwrite deletes the previous run's outputs
    if not cfg.train.overwrite:  # refusing a run_dir that holds a run deletes nothing: before the (slow) build
        claim_run_dir(run_dir, resume=cfg.train.resume, overwrite=False, lock=not for_eval)  # eval only reads
    if cfg.train.resume:
        check_resume_steps(run_dir, cfg.rl.steps, "rl.steps")
    task, tok, stop_ids = _task_and_tokenizer(cfg, run_dir, will_save=not for_eval)
    resume_from = latest_checkpoint(run_dir) if cfg.train.resume else None
    # every weight is loaded next (HF checkpoint or resumed state): skip the random initialisation
    model = build_gpt(cfg.model, groups, seed=cfg.train.seed,
                      initialize=not (cfg.model.hf_path or resume_from is not None))
    if resume_from is None:
        _warm_start(cfg, model, groups, task, tok)
    ref_model = None
    if cfg.rl.loss.kl_coef > 0 and not for_eval:  # evaluation never reads the reference
        if resume_from is None:
            ref_model = build_gpt(cfg.model, groups, seed=cfg.train.seed, initialize=False)
            ref_model.load_state_dict(model.state_dict())
        else:  # the reference is the initial policy, not the resumed one: warm-start it the same way
            ref_model = build_gpt(cfg.model, groups, seed=cfg.train.seed, initialize=not cfg.model.hf_path)
            _warm_start(cfg, ref_model, groups, task, tok)
        for p in ref_model.parameters():
            p.requires_grad_(False)
    if optimizer_factory is None:  # a schedule without decay_steps decays over the RL updates
        optimizer = build_optimizer(model, cfg.optimizer, groups, total_steps=cfg.rl.steps)
    else:
        optimizer = optimizer_factory(model, cfg.optimizer, groups)
    if isinstance(optimizer, LograOptimizer) and cfg.kl.mode != "none":
        # fail before any rollout when the requested probe cannot run on this model / layout
        logger.info("KL probe: %s", probe_method(cfg.kl.probe, optimizer.sketches, groups.pp_size))
    if cfg.train.overwrite:  # deletes the previous run: only once the prompts, model and optimizer are known to work
        claim_run_dir(run_dir, resume=cfg.train.resume, overwrite=True)
    if not for_eval:  # evaluation never writes into the run directory
        _save_tokenizer(cfg, tok, run_dir)
    controller = KLController(cfg.kl)
    state = RLState()
    state.baseline.weight = cfg.rl.advantage.baseline_weight
    bundle = _OptimizerWithRL(optimizer, controller, state)
    if resume_from is not None:
        load_checkpoint(resume_from, model, bundle, groups, checksums=cfg.train.checkpoint_checksums,
                        model_config=cfg.model)
        logger.info("%s %s at RL step %d", "evaluating" if for_eval else "resumed from", resume_from, state.step)
    engine = build_engine(cfg, model, groups)

    # evaluation syncs in process: a directory transport would prune the run's delta files and write anchors
    # that an external consumer of that directory would then follow
    sync_cfg = dataclasses.replace(cfg.sync, transport="inprocess") if for_eval else cfg.sync
    sync = PolicySync(sync_cfg, model=model, model_cfg=cfg.model, optimizer=optimizer, engine=engine,
                      groups=groups, run_dir=run_dir)
    sync.full(state.weight_version)
    comps = RLComponents(cfg=cfg, groups=groups, model=model, optimizer=optimizer, controller=controller,
                         engine=engine, task=task, tokenizer=tok, sync=sync, ref_model=ref_model,
                         stop_ids=stop_ids)
    return comps, state, bundle


_LOGGED = ("reward_mean", "accuracy", "alpha", "kl_predicted", "kl_actual", "step_seconds", "rollout_tokens_per_second",
           "train_tokens_per_second", "gpu_memory_peak_bytes")
"""Record fields of the rank-0 log line every ``train.log_interval`` updates (without a progress bar)."""


@releasing_run_dir
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
      the run that started at step 0 writes as soon as it has measured it (None when neither has it).
      ``eval_accuracy_after`` — held-out accuracy after update ``steps`` (None for a run stopped early).
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
    saved_config = redact_config(to_dict(cfg))  # what config.yaml and the checkpoints hold: no credentials
    if is_rank0():
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(saved_config, sort_keys=False))
    start_step = state.step
    # what earlier processes of the run did, read before this one's summary replaces theirs
    previous = _previous_summary(run_dir / "summary.json", start_step) if start_step else {}
    metrics = MetricsWriter(run_dir, truncate_after=state.step if cfg.train.resume else None)
    setup_seconds = time.perf_counter() - t_start
    eval_before = evaluate_accuracy(comps)
    if eval_before is None:
        if cfg.task.num_eval == 0:
            logger.info("no held-out evaluation (task.num_eval=0): eval_accuracy is null in metrics.jsonl and "
                        "summary.json")
        else:  # asked for, but no prompt of the sources is held out (a small file, task.eval_modulus)
            logger.warning("no held-out evaluation: task.num_eval=%d, but no prompt of the task's sources is held "
                           "out (prompt hash %% task.eval_modulus == 0): eval_accuracy is null in metrics.jsonl and "
                           "summary.json; add prompts or choose another task.eval_modulus", cfg.task.num_eval)
    elif start_step:
        logger.info("held-out accuracy at RL step %d (resumed): %.3f", start_step, eval_before)
    else:
        logger.info("held-out accuracy before RL: %.3f", eval_before)
    if not start_step:  # kept at once: a run killed before its summary.json still reports it when resumed
        record_before_values(run_dir, {"eval_accuracy_before": eval_before})
    progress = _progress(cfg, state.step) if cfg.train.progress and is_rank0() else None
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
            record = rl_update(comps, state)
            if cfg.rl.eval_interval and (state.step % cfg.rl.eval_interval == 0 or state.step == cfg.rl.steps):
                record["eval_accuracy"] = evaluate_accuracy(comps)
            record["memory_bytes"] = _rss_bytes()
            metrics.write(record)
            if progress is not None:
                progress[0].update(progress[1], advance=1, **_bar_fields(record))
            elif is_rank0() and state.step % cfg.train.log_interval == 0:
                logger.info("rl step %d %s", state.step,
                            {k: record.get(k) for k in _LOGGED if record.get(k) is not None})
            if cfg.train.save_interval and state.step % cfg.train.save_interval == 0 and state.step != cfg.rl.steps:
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
        if state.step > saved:  # the last step's checkpoint, before the final evaluation (not again if already saved)
            save_checkpoint(run_dir, state.step, comps.model, bundle, comps.groups, config=saved_config,
                            keep_last=cfg.train.keep_last, checksums=cfg.train.checkpoint_checksums)
        if stopped is None:  # a stop asked for during that save: no final evaluation
            stopped = stop.check_after_training("the final save")
        if stopped is not None:
            eval_after = None
        elif record.get("eval_accuracy") is not None:
            eval_after = record["eval_accuracy"]
        elif state.step == start_step:  # nothing trained: the policy evaluated before the loop
            eval_after = eval_before
        else:
            eval_after = evaluate_accuracy(comps)
            stopped = stop.check_after_training("the final evaluation")
        metrics.close()
        rl_seconds, total_seconds = time.perf_counter() - rl_start, time.perf_counter() - t_start
        eval_before_run = previous.get("eval_accuracy_before") if start_step else eval_before
        summary = {
            "optimizer": cfg.optimizer.name, "task": cfg.task.datasets, "steps": state.step,
            "eval_accuracy_before": eval_before_run, "eval_accuracy_after": eval_after,
            "setup_seconds": _run_total(previous, "setup_seconds", setup_seconds, start_step),
            "rl_seconds": _run_total(previous, "rl_seconds", rl_seconds, start_step),
            "total_seconds": _run_total(previous, "total_seconds", total_seconds, start_step),
            "run_dir": str(run_dir), "stopped": stopped,
            "resumed_from_step": start_step, "segment_steps": state.step - start_step,
            "segment_eval_accuracy_before": eval_before, "segment_setup_seconds": setup_seconds,
            "segment_rl_seconds": rl_seconds, "segment_total_seconds": total_seconds,
        }
        if is_rank0():
            atomic_write_text(run_dir / "summary.json", strict_dumps(summary, indent=1))
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


def _previous_summary(path: Path, start: int) -> dict:
    """What the run's previous ``summary.json`` (``path``) says about the run before step ``start`` (the step
    this process resumed from): ``eval_accuracy_before`` (the held-out accuracy before update 1) and, when that
    summary ends at ``start``, ``setup_seconds`` / ``rl_seconds`` / ``total_seconds``
    (:func:`~megatron_logra.metrics.previous_summary_values`)."""
    return previous_summary_values(path, start, ("eval_accuracy_before",),
                                   ("setup_seconds", "rl_seconds", "total_seconds"))


def _run_total(previous: dict, key: str, segment: float, start: int) -> Optional[float]:
    """The whole run's ``key`` time: this process's ``segment`` plus the earlier processes' (``previous``);
    None when a resumed run (``start`` > 0) does not know the earlier ones'."""
    if not start:
        return segment
    return previous[key] + segment if key in previous else None


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return 0


def _bar_fields(record: dict) -> dict:
    def f(key):
        v = record.get(key)
        return float("nan") if v is None else float(v)

    return {"reward": f("reward_mean"), "acc": f("accuracy"), "kl_pred": f("kl_predicted"),
            "kl_act": f("kl_actual"), "alpha": f("alpha")}


def _progress(cfg: RunConfig, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]rl[/bold]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f} acc {task.fields[acc]:.2f}"),
        TextColumn("KL pred/act {task.fields[kl_pred]:.2e}/{task.fields[kl_act]:.2e} α {task.fields[alpha]:.2f}"),
        TimeElapsedColumn(),
    )
    task_id = progress.add_task("rl", total=cfg.rl.steps, completed=start, reward=math.nan, acc=math.nan,
                                kl_pred=math.nan, kl_act=math.nan, alpha=math.nan)
    progress.start()
    return progress, task_id

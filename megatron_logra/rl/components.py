"""What the RL loop works on, built and checked: the start-time checks of the config
(:func:`check_config`, also run by ``megatron-logra config``) and :func:`build_components` (process groups,
task, tokenizer, model and its warm start, reference model, optimizer, KL controller, rollout engine and
policy sync, resumed from the latest checkpoint when asked). The task, tokenizer and stop tokens are built and
checked by :mod:`megatron_logra.rl.task_setup`."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

from megatron_logra.checkpoint import latest_checkpoint, load_checkpoint
from megatron_logra.checkpoint.run_dir import check_resume_steps, claim_run_dir
from megatron_logra.config import RunConfig
from megatron_logra.convert.hf_config import model_config_from_hf
from megatron_logra.kl.controller import KLController
from megatron_logra.kl.probe import probe_method
from megatron_logra.memory.preflight import memory_preflight
from megatron_logra.models.gpt import build_gpt
from megatron_logra.optim import LograOptimizer, build_optimizer
from megatron_logra.parallel import initialize_parallel, world_group
from megatron_logra.profiling import check_job_profile
from megatron_logra.rl.batch_layout import check_rl_batch_layout
from megatron_logra.rl.loop import RLComponents, RLState
from megatron_logra.rl.policy_sync import PolicySync
from megatron_logra.rl.task_setup import task_and_tokenizer as _task_and_tokenizer
from megatron_logra.rl.warm_start import save_run_tokenizer, warm_start
from megatron_logra.rollout import build_engine
from megatron_logra.rollout.sglang_checks import check_engine_dtype

logger = logging.getLogger(__name__)

__all__ = ["build_components", "check_config", "check_native_step_control"]


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


def check_config(cfg: RunConfig) -> None:
    """The start-time checks of the RL job that need no process group, model or GPU and write nothing, as
    ``megatron-logra config`` runs them (``cfg`` is changed as the job changes it: take a copy to keep it):
    :func:`_check_settings`, a resumed run's ``rl.steps`` against its latest checkpoint, and
    :func:`~megatron_logra.rl.task_setup.task_and_tokenizer`. What they refuse, the job refuses with the same
    error. Not checked here: the batch layout over the launch's DP / PP ranks, SGLang's presence, the memory
    plan, ``train.run_dir``'s state, the model build, the weights and the KL probe."""
    _check_settings(cfg)
    if cfg.train.resume:
        check_resume_steps(cfg.train.run_dir, cfg.rl.steps, "rl.steps")
    _task_and_tokenizer(cfg, Path(cfg.train.run_dir), will_save=False)


def build_components(cfg: RunConfig, optimizer_factory=None, *, for_eval: bool = False,
                     checkpoint: Optional[Path] = None) -> tuple[RLComponents, RLState, _OptimizerWithRL]:
    """Everything the loop needs, warm-started (and resumed when asked).

    ``optimizer_factory(model, cfg.optimizer, groups)``, when given, replaces ``build_optimizer``
    (benchmarks plug in other optimizers with the ``DenseAdamW`` interface this way).

    ``for_eval``: what held-out evaluation (``megatron-logra eval``) reads: no reference model for
    ``rl.loss.kl_coef`` (``ref_model`` is None: neither built nor warm-started), and nothing the run wrote
    is changed: a missing ``RUN/tokenizer`` is rebuilt from the config with a warning, not saved, and the
    engine is synced in process whatever ``sync.transport`` says (a directory transport would prune the
    run's delta files and write anchors). An in-process SGLang engine still writes its scratch model
    config under ``RUN/sglang_model``. ``checkpoint``: the checkpoint a resume (or evaluation) loads instead of the
    latest one (``megatron-logra eval RUN --ckpt-step N``)."""
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
    if not for_eval:
        check_job_profile(cfg.profile)
    run_dir = Path(cfg.train.run_dir)
    # every check that can refuse the run comes before train.overwrite deletes the previous run's outputs
    if not cfg.train.overwrite:  # refusing a run_dir that holds a run deletes nothing: before the (slow) build
        claim_run_dir(run_dir, resume=cfg.train.resume, overwrite=False, lock=not for_eval,
                      writes=not for_eval)  # eval only reads (a read-only run directory too)
    if cfg.train.resume:
        check_resume_steps(run_dir, cfg.rl.steps, "rl.steps")
    task, tok, stop_ids = _task_and_tokenizer(cfg, run_dir, will_save=not for_eval, group=world_group())
    resume_from = (checkpoint or latest_checkpoint(run_dir)) if cfg.train.resume else None
    # every weight is loaded next (HF checkpoint or resumed state): skip the random initialisation
    model = build_gpt(cfg.model, groups, seed=cfg.train.seed,
                      initialize=not (cfg.model.hf_path or resume_from is not None))
    if resume_from is None:
        warm_start(cfg, model, groups, task, tok)
    ref_model = None
    if cfg.rl.loss.kl_coef > 0 and not for_eval:  # evaluation never reads the reference
        if resume_from is None:
            ref_model = build_gpt(cfg.model, groups, seed=cfg.train.seed, initialize=False)
            ref_model.load_state_dict(model.state_dict())
        else:  # the reference is the initial policy, not the resumed one: warm-start it the same way
            ref_model = build_gpt(cfg.model, groups, seed=cfg.train.seed, initialize=not cfg.model.hf_path)
            warm_start(cfg, ref_model, groups, task, tok)
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
        save_run_tokenizer(cfg, tok, run_dir)
    controller = KLController(cfg.kl)
    state = RLState()
    state.baseline.weight = cfg.rl.advantage.baseline_weight
    bundle = _OptimizerWithRL(optimizer, controller, state)
    if resume_from is not None:
        load_checkpoint(resume_from, model, bundle, groups, checksums=cfg.train.checkpoint_checksums,
                        model_config=cfg.model, training=not for_eval)
        logger.info("%s %s at RL step %d", "evaluating" if for_eval else "resumed from", resume_from, state.step)
    engine = build_engine(cfg, model, groups, tokenizer=tok)

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

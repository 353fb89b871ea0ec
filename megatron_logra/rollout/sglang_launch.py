"""Construction of the SGLang rollout engine from the run's config (:func:`engine_arguments`).

:meth:`SGLangEngine.from_config <megatron_logra.rollout.sglang_engine.SGLangEngine.from_config>` builds
the engine from what this returns; the split keeps the engine's protocol (generation and weight
sync, :mod:`megatron_logra.rollout.sglang_engine`) apart from how its target is reached:

* ``rl.rollout.sglang_url`` set: a running server, generated on by rank 0 of each model-parallel
  group and synced by global rank 0 (one engine shared by every DP replica);
* otherwise an in-process ``sglang.Engine`` per DP replica, started by the replica's ``mp`` rank 0
  on the replica's own GPUs, from ``RUN/sglang_model/dp<k>/config.json`` with dummy weights (the
  first refit loads them), inside :func:`~megatron_logra.rollout.sglang_env.engine_start_environment`.

Every rank calls :func:`engine_arguments` (its checks and starts are collectives: a refusal reaches
all ranks together). SGLang is imported lazily, on the driver only.
"""

from __future__ import annotations

import atexit
import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_logra.parallel import group_size
from megatron_logra.rollout.driver import is_driver, share_from_driver
from megatron_logra.rollout.sglang_api import (
    check_engine_kwargs,
    engine_context_length,
    engine_hf_config,
    require_sglang,
    resolve_serialization,
    sglang_mem_fraction,
)
from megatron_logra.rollout.sglang_checks import check_engine_dtype
from megatron_logra.rollout.sglang_env import TrainerSignalEngine, engine_start_environment
from megatron_logra.rollout.sglang_setup import (ADMIN_API_KEY_ENV, ADMIN_KEY_FIELD, check_engine_gpus,
                                                 contiguous_run, resolve_api_key)

logger = logging.getLogger(__name__)

__all__ = ["engine_arguments"]


def engine_arguments(cfg: Any, groups: Any) -> dict[str, Any]:
    """The keyword arguments of :class:`~megatron_logra.rollout.sglang_engine.SGLangEngine` for the
    engine ``cfg.rl.rollout`` asks for (see :meth:`SGLangEngine.from_config
    <megatron_logra.rollout.sglang_engine.SGLangEngine.from_config>`): the server's or the started
    in-process engine's ``generate_fn``/``target`` on the driving ranks (None elsewhere), the groups
    that drive generation and sync, and an in-process engine's ``close_fn``. A collective: every rank calls it."""
    from megatron_logra.sync.sglang_client import SGLangEngineTarget, SGLangServerTarget
    from megatron_logra.sync.sglang_loader import LOADER_PATH

    ro = cfg.rl.rollout
    mp = groups.mp if group_size(groups.mp) > 1 else None
    common = dict(vocab_size=cfg.model.vocab_size, padded_vocab_size=cfg.model.padded_vocab_size(groups.tp_size),
                  send_seed=ro.sglang_sampling_seed, trainer_dtype=str(cfg.model.params_dtype),
                  deltas=cfg.sync.mode == "delta" and cfg.optimizer.name == "logra")  # PolicySync's delta_mode
    if ro.sglang_url:
        serialization = resolve_serialization(ro.sglang_serialization, ro.sglang_url, torch.cuda.is_available())
        world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        api_key = resolve_api_key(ro.sglang_api_key)  # every rank: a key that cannot be sent is refused by all
        admin_key = resolve_api_key(ro.sglang_admin_api_key, field=ADMIN_KEY_FIELD, env_var=ADMIN_API_KEY_ENV)

        def server() -> SGLangServerTarget:
            return SGLangServerTarget(ro.sglang_url, api_key=api_key, admin_api_key=admin_key,
                                      timeout=ro.sglang_timeout, serialization=serialization)

        gen_target = server() if is_driver(mp) else None
        if gen_target is not None and ro.sglang_sampling_seed:
            info = gen_target.server_info()
            if not (isinstance(info, dict) and info.get("enable_deterministic_inference")):
                logger.warning("rl.rollout.sglang_sampling_seed: the server at %s was not started with "
                               "--enable-deterministic-inference, so SGLang ignores the per-request seeds",
                               ro.sglang_url)
        sync_target = (gen_target or server()) if is_driver(world) else None

        def generate(payload: dict) -> Any:
            return gen_target.request("POST", "/generate", payload)[1]

        logger.info("sglang engine: server %s (generation by mp rank 0, sync by global rank 0; %s payloads)",
                    ro.sglang_url, serialization)
        return dict(generate_fn=generate if gen_target is not None else None, target=sync_target, gen_group=mp,
                    sync_group=world, **common)

    check_engine_dtype(cfg.model.params_dtype)  # every rank: all of them refuse together
    gpus = {"tp_size": ro.sglang_tp or groups.tp_size, "base_gpu_id": 0}
    if torch.cuda.is_available():  # the driver checks its replica's GPUs; every rank of the replica refuses
        gpus["base_gpu_id"] = torch.cuda.current_device()
        gpus.update((k, int(v)) for k, v in ro.sglang_engine_args.items() if k in gpus)
        share_from_driver(lambda: check_engine_gpus(gpus["tp_size"], base_gpu_id=gpus["base_gpu_id"],
                                                    device_count=torch.cuda.device_count(),
                                                    replica_gpus=_replica_gpus(mp)), mp)
    started: list = []  # the driver's engine (not picklable: kept here, only the outcome is shared)

    def start() -> None:  # on the driver; its error (bad engine args, no memory) reaches every rank
        sglang = require_sglang()
        model_dir = Path(cfg.train.run_dir) / "sglang_model" / f"dp{groups.dp_rank}"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(engine_hf_config(cfg.model, groups.tp_size), indent=1))
        fraction = ro.mem_fraction_static
        if torch.cuda.is_available():  # the trainer's memory already in use counts against SGLang's fraction
            fraction = sglang_mem_fraction(fraction, *torch.cuda.mem_get_info())
        kwargs = dict(model_path=str(model_dir), load_format="dummy", dtype=str(cfg.model.params_dtype),
                      **gpus, mem_fraction_static=fraction, skip_tokenizer_init=True,
                      random_seed=cfg.train.seed, context_length=engine_context_length(cfg.model),
                      custom_weight_loader=[LOADER_PATH], log_level="error")
        if ro.sglang_sampling_seed:  # SGLang honours per-request seeds only in deterministic mode
            kwargs["enable_deterministic_inference"] = True
        kwargs.update(ro.sglang_engine_args)
        check_engine_kwargs(kwargs, _server_arg_names(), str(getattr(sglang, "__version__", "?")))
        with engine_start_environment():
            engine = TrainerSignalEngine(sglang.Engine(**kwargs))  # SIGTERM stays the trainer's
        atexit.register(engine.shutdown)
        logger.info("sglang engine: in-process, tp_size=%d, share %.2f (SGLang mem_fraction_static %.2f), %s",
                    kwargs["tp_size"], ro.mem_fraction_static, kwargs["mem_fraction_static"], model_dir)
        started.append(engine)

    share_from_driver(start, mp)
    engine = started[0] if started else None
    target = SGLangEngineTarget(engine) if engine is not None else None
    gen_fn = (lambda payload: engine.generate(**payload)) if engine is not None else None
    return dict(generate_fn=gen_fn, target=target, gen_group=mp, sync_group=mp,
                close_fn=engine.shutdown if engine is not None else None, **common)


def _server_arg_names() -> Optional[set]:
    """The field names of the installed ``sglang.srt.server_args.ServerArgs`` (None when they cannot be read)."""
    try:
        import dataclasses

        from sglang.srt.server_args import ServerArgs

        return {f.name for f in dataclasses.fields(ServerArgs)}
    except Exception:  # not a dataclass any more, or not importable: let sglang.Engine decide
        return None


def _replica_gpus(mp: Any) -> int:
    """GPUs from this rank's device up that its model replica (``mp``; None: this rank alone) uses."""
    if mp is None:
        return 1
    return contiguous_run(dist.get_process_group_ranks(mp), dist.get_rank())


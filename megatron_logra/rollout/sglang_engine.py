"""SGLang rollout engine: the :class:`~megatron_logra.rollout.engine.RolloutEngine` protocol on
``sglang.Engine`` (in process, on the trainer's GPUs) or on a running SGLang server (HTTP).

Generation goes through SGLang's native ``/generate`` (``Engine.generate`` takes the same fields):
``{"input_ids": [[...], ...], "sampling_params": {...}, "return_logprob": true}``; the answer is
one dict per prompt, in order, with ``output_ids`` and ``meta_info`` holding
``output_token_logprobs`` (one ``[logprob, token_id, text_or_null]`` per generated token),
``finish_reason`` (``{"type": "stop", "matched": id}`` or ``{"type": "length", "length": n}``) and,
on SGLang >= 0.5, ``weight_version`` (a string). :mod:`megatron_logra.rollout.sglang_api`
holds the pure translations (tested against those shapes).

Log-prob convention (see :mod:`megatron_logra.rollout.engine`: ``log_softmax(z / T)`` at the sampled
token, before top-p truncation; ``softmax(z)`` when greedy). SGLang returns, for ``T > 0``, ``log`` of
the temperature-scaled probabilities, taken -- depending on its version and sampling backend -- before
the top-p truncation (as ours) or *renormalised over the top-p nucleus* (its sampler renormalises before
taking logs where it applies ``min_p``, and in some releases always); for greedy requests
``log_softmax(z)``. So:

* ``top_p == 1``: identical to the trainer's convention (up to kernel rounding);
* ``top_p < 1``: SGLang's value may be ``ours - log(nucleus mass) >= ours``; the nucleus mass is not
  returned, so it cannot be converted back. A warning is logged once; the mismatch shows up in the
  ``mismatch`` metric and the truncated importance weights absorb it;
* ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (older: ``RETURN_ORIGINAL_LOGPROB``) makes SGLang return
  ``log_softmax(z)`` whatever ``T``: with ``T`` not in ``{0, 1}`` the engine refuses to start
  (checked in this process's environment, which an in-process engine inherits; a server's
  environment cannot be seen: do not set it there).

Padded vocabulary: the trainer gives columns ``>= ModelConfig.vocab_size`` the logit
``PADDED_LOGIT``; SGLang has no such hook. The engine's model has ``E`` ids (its ``config.
vocab_size``, reported by the sync loader): ``E = padded_vocab_size`` for the in-process engine
(its ``config.json`` is written padded) or for a server started from such a config, ``E =
vocab_size`` for a server started from the Hugging Face checkpoint or the exported config. Every
request carries a ``logit_bias`` of ``PADDED_LOGIT`` on the padded ids the engine has, ``[vocab_size,
E)`` (SGLang's ``SamplingParams.verify`` refuses keys ``>= E``; probability ~0 on both sides), and
:mod:`~megatron_logra.sync.sglang_state` cuts refits and dense delta entries of
``embed_tokens``/``lm_head`` to ``E`` rows (SGLang's ``VocabParallelEmbedding.weight_loader``
asserts exactly ``E``). ``E`` outside ``[vocab_size, padded_vocab_size]`` is refused when the
engine is built. With ``E < padded_vocab_size`` the drift check compares the first ``E`` rows of
``embed_tokens``/``lm_head`` (:attr:`SGLangEngine.fingerprint_vocab_rows`, passed to
``rl.weights.trainer_fingerprint``): the padded rows the engine lacks are not compared.

Weights: synchronised only through :mod:`megatron_logra.sync.sglang_client` (sketch deltas via the
custom loader, dense refits, fingerprints, versions); this module just decides who talks to it.

Ranks: SGLang runs its own tensor parallelism, so one process per engine talks to it.

* generation: rank 0 of the model-parallel group (``groups.mp``: the TP x PP ranks of one DP
  replica, which all roll out the same prompts) generates and broadcasts the rollouts (token ids,
  log-probs, flags) to the group;
* weight sync: for an in-process engine (one per DP replica, started by that replica's ``mp`` rank 0
  with ``tp_size = rl.rollout.sglang_tp or parallel.tp`` on GPUs ``[cuda.current_device(), +tp_size)``,
  which must be the replica's own: ``sglang_setup.check_engine_gpus``), the same rank applies
  and broadcasts the outcome over ``groups.mp``; for a server URL (one engine shared by every DP
  replica), global rank 0 syncs it and broadcasts over the world, which also keeps other replicas
  from generating before the update landed.

An in-process engine starts without torchrun's variables in the environment its schedulers inherit
(:func:`engine_start_environment`), and the trainer's environment is restored once it has started.

Errors on the driving rank (a rejected delta, an HTTP failure) are re-raised on every rank of the
group with the same type (``SyncError`` keeps its ``kind``), so ``PolicySync``'s fallback to a full
refit runs on all ranks together. SGLang is imported lazily (:func:`require_sglang`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron_logra.parallel import group_size
from megatron_logra.rollout.driver import is_driver, share_from_driver
from megatron_logra.rollout.engine import Rollout, SamplingParams
from megatron_logra.rollout.sglang_api import (
    build_generate_payload,
    check_engine_kwargs,
    check_logprob_convention,
    engine_context_length,
    engine_hf_config,
    parse_generate_response,
    require_sglang,
    resolve_serialization,
    sglang_mem_fraction,
)
from megatron_logra.rollout.sglang_setup import (ADMIN_API_KEY_ENV, ADMIN_KEY_FIELD, check_engine_gpus,
                                                 contiguous_run, resolve_api_key)

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_DTYPES", "SGLangEngine", "check_engine_dtype", "check_engine_vocab", "share_from_driver"]


# --------------------------------------------------------------------------- one driver per group


def _drain(stream: Iterator[Any]) -> None:
    for _ in stream:
        pass


# --------------------------------------------------------------------------- the engine


class SGLangEngine:
    """Rollout engine backed by SGLang (see the module docstring for conventions and ranks).

    ``generate_fn(payload) -> response`` exists on the generation driver (rank 0 of ``gen_group``),
    ``target`` (a :mod:`~megatron_logra.sync.sglang_client` target) on the sync driver (rank 0 of
    ``sync_group``); other ranks pass None. Build it with :meth:`from_config`. The constructor reads
    the engine's version on the sync driver and shares it (a collective: every rank constructs).
    ``deltas``: sketch deltas will be sent (``sync.mode=delta`` with LoGRA); the constructor then has the
    target refuse an engine that cannot apply them (its ``check_delta_sync``: pipeline stages, data-parallel
    attention), on every rank, before the first update instead of at every one.
    """

    def __init__(self, *, generate_fn: Optional[Callable[[dict], Any]], target: Any, vocab_size: int,
                 padded_vocab_size: int, gen_group: Any = None, sync_group: Any = None, send_seed: bool = False,
                 close_fn: Optional[Callable[[], None]] = None, deltas: bool = True) -> None:
        if is_driver(gen_group) and generate_fn is None:
            raise ValueError("the generation driver (rank 0 of gen_group) needs generate_fn")
        if is_driver(sync_group) and target is None:
            raise ValueError("the sync driver (rank 0 of sync_group) needs a sglang_client target")
        self.generate_fn, self.target = generate_fn, target
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.gen_group, self.sync_group, self.send_seed = gen_group, sync_group, send_seed
        self._close_fn = close_fn
        def start() -> tuple[int, Optional[int]]:
            check = getattr(self.target, "check_delta_sync", None)
            if deltas and callable(check):
                check()
            return int(self.target.weight_version), getattr(self.target, "vocab_size", None)

        version, engine_vocab = share_from_driver(start, sync_group)
        self._version = int(version)
        self.engine_vocab_size = check_engine_vocab(engine_vocab, vocab_size, padded_vocab_size)

    # ------------------------------------------------------------------ weights (sync_client, driver only)

    @property
    def weight_version(self) -> int:
        """Version of the engine's weights (shared from the sync driver after every update)."""
        return self._version

    @property
    def receives_weights(self) -> bool:
        """True on the sync driver only: the one rank whose payloads reach SGLang. Other ranks take
        part in every weight call (pass ``None`` as the delta) without building payloads."""
        return is_driver(self.sync_group)

    def _synced(self, fn: Callable[[], Any]) -> Any:
        result, self._version = share_from_driver(lambda: (fn(), int(self.target.weight_version)), self.sync_group)
        return result

    def apply_sketch_delta(self, delta: Any) -> int:
        """Send one sketch delta through ``sglang_client`` (driver; other ranks' ``delta`` is unused and
        may be None); every rank gets the new version or the same ``SyncError`` (the engine kept its
        weights). ``delta`` may be a zero-argument callable that builds it: the driver calls it inside
        the shared outcome, so a failure while building reaches every rank too."""
        self._synced(lambda: self.target.apply_sketch_delta(delta() if callable(delta) else delta))
        return self._version

    def update_weights_full(self, hf_state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Dense refit (HF names, full tensors) through ``sglang_client``; then ``weight_version = version``.

        ``hf_state`` may be a stream (``rl.weights.iter_hf_params``) whose producer runs TP/PP
        collectives: every rank consumes its stream to the end -- the driver while sending, the
        others before they wait for its outcome, the driver also after a failed send.
        """
        if isinstance(hf_state, Mapping):
            self._synced(lambda: self.target.update_weights_full(hf_state, version))
            return
        stream = iter(hf_state)

        def drive() -> None:
            try:
                self.target.update_weights_full(stream, version)
            finally:
                _drain(stream)

        if not is_driver(self.sync_group):
            _drain(stream)
        self._synced(drive)

    @property
    def fingerprint_vocab_rows(self) -> Optional[int]:
        """The rows of ``embed_tokens``/``lm_head`` the engine holds when fewer than the trainer's
        padded vocabulary (its fingerprint covers those; module docstring), else None."""
        return self.engine_vocab_size if self.engine_vocab_size < self.padded_vocab_size else None

    def fingerprint(self) -> Optional[dict[str, str]]:
        """The engine's per-tensor hashes in HF layout (``sglang_client``), or None when it cannot
        (a fingerprint error). ``embed_tokens``/``lm_head`` cover :attr:`fingerprint_vocab_rows` rows."""
        return share_from_driver(lambda: self.target.fingerprint(), self.sync_group)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """One rollout per prompt, in order, from the engine's current weights (driver generates, group shares)."""

        def run() -> list[Rollout]:
            check_logprob_convention(params)
            for i, p in enumerate(prompts):
                if not p or min(p) < 0 or max(p) >= self.vocab_size:
                    raise ValueError(f"prompt {i} is empty or has token ids outside [0, {self.vocab_size})")
            payload = build_generate_payload(prompts, params, vocab_size=self.vocab_size,
                                             padded_vocab_size=self.padded_vocab_size, send_seed=self.send_seed,
                                             engine_vocab_size=self.engine_vocab_size)
            return parse_generate_response(self.generate_fn(payload), prompts, self._version,
                                           stop_token_ids=params.stop_token_ids)

        return share_from_driver(run, self.gen_group)

    def close(self) -> None:
        """Shut an in-process engine down (no-op for a server or on other ranks)."""
        if self._close_fn is not None:
            fn, self._close_fn = self._close_fn, None
            fn()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg: Any, groups: Any) -> "SGLangEngine":
        """The engine ``cfg.rl.rollout`` asks for (``sglang_url`` set: that server; else an in-process
        ``sglang.Engine`` per DP replica loading ``RUN/sglang_model/config.json`` with dummy weights, in
        ``model.params_dtype``, which must be bfloat16 or float16: :func:`check_engine_dtype`). Sketch deltas
        are expected (``deltas``, see the class) when ``sync.mode=delta`` and ``optimizer.name=logra``."""
        from megatron_logra.sync.sglang_client import SGLangEngineTarget, SGLangServerTarget
        from megatron_logra.sync.sglang_loader import LOADER_PATH

        ro = cfg.rl.rollout
        mp = groups.mp if group_size(groups.mp) > 1 else None
        common = dict(vocab_size=cfg.model.vocab_size, padded_vocab_size=cfg.model.padded_vocab_size(groups.tp_size),
                      send_seed=ro.sglang_sampling_seed,
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
            gen_fn = None
            if gen_target is not None:
                def gen_fn(payload: dict) -> Any:
                    return gen_target.request("POST", "/generate", payload)[1]
            logger.info("sglang engine: server %s (generation by mp rank 0, sync by global rank 0; %s payloads)",
                        ro.sglang_url, serialization)
            return cls(generate_fn=gen_fn, target=sync_target, gen_group=mp, sync_group=world, **common)

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
                engine = sglang.Engine(**kwargs)
            atexit.register(engine.shutdown)
            logger.info("sglang engine: in-process, tp_size=%d, share %.2f (SGLang mem_fraction_static %.2f), %s",
                        kwargs["tp_size"], ro.mem_fraction_static, kwargs["mem_fraction_static"], model_dir)
            started.append(engine)

        share_from_driver(start, mp)
        engine = started[0] if started else None
        target = SGLangEngineTarget(engine) if engine is not None else None
        gen_fn = (lambda payload: engine.generate(**payload)) if engine is not None else None
        return cls(generate_fn=gen_fn, target=target, gen_group=mp, sync_group=mp,
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


def check_engine_vocab(engine_vocab: Optional[int], vocab_size: int, padded_vocab_size: int) -> int:
    """The engine's vocabulary ``E`` (``padded_vocab_size`` when its loader does not say), refused
    (``ValueError``) outside ``[vocab_size, padded_vocab_size]``: a smaller model lacks tokens the
    trainer samples; a larger one has ids the trainer cannot score, and SGLang's embedding loader
    takes exactly ``E`` rows, which the trainer's refits do not have."""
    if engine_vocab is None:
        return padded_vocab_size
    if not vocab_size <= engine_vocab <= padded_vocab_size:
        raise ValueError(
            f"the SGLang engine's model has vocab_size={engine_vocab}, the trainer model.vocab_size={vocab_size} "
            f"padded to {padded_vocab_size} (model.make_vocab_size_divisible_by x TP): the engine's vocabulary must "
            f"lie in [{vocab_size}, {padded_vocab_size}]; serve a model whose config has vocab_size={vocab_size} "
            f"(the Hugging Face checkpoint, or what `convert mcore-to-hf` writes) or {padded_vocab_size}, or set model.vocab_size "
            "to the served model's")
    return int(engine_vocab)


ENGINE_DTYPES = ("bfloat16", "float16")
"""``model.params_dtype`` values an in-process engine runs in."""


def check_engine_dtype(params_dtype: str) -> None:
    """Refuse a ``model.params_dtype`` an in-process ``sglang.Engine`` cannot run in (``ValueError``).

    The engine is started in the trainer's dtype (sketch deltas merge bit for bit on both sides), and
    SGLang's CUDA kernels (``sgl_kernel`` RMSNorm, fused RoPE) are dispatched for float16 / bfloat16
    only: a float32 engine fails in its first forward, after start-up. A server (``rl.rollout.
    sglang_url``) runs in the dtype it was started with and is not checked here.
    """
    if str(params_dtype) not in ENGINE_DTYPES:
        raise ValueError(
            f"model.params_dtype={params_dtype!r}: an in-process SGLang engine (rl.rollout.engine=sglang without "
            f"rl.rollout.sglang_url) runs in the trainer's dtype, and SGLang's CUDA kernels are built for float16 "
            f"and bfloat16 only; set model.params_dtype=bfloat16 (--bf16), or use rl.rollout.engine=embedded")


_TRAINER_ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_NCCL_")
"""Variables SGLang's start overwrites in the caller's process for its workers (restored afterwards)."""
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_ENV_PREFIXES = ("TORCHELASTIC_",)
"""What torchrun exports to its workers (hidden from SGLang's start, restored afterwards)."""


def _is_launcher_variable(key: str) -> bool:
    return key in _LAUNCHER_ENV or key.startswith(_LAUNCHER_ENV_PREFIXES)


@contextlib.contextmanager
def engine_start_environment() -> Iterator[None]:
    """The environment an in-process ``sglang.Engine`` starts in, and the trainer's afterwards.

    On entry, torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_*``, ``ROLE_*``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``) are taken out of
    this process's environment: the scheduler processes the constructor spawns inherit it, and their
    own ``init_process_group("tcp://127.0.0.1:<port>")`` must not see torchrun's. With
    ``TORCHELASTIC_USE_AGENT_STORE=True`` torch's rendezvous assumes torchrun's agent serves the
    store and makes every rank a TCPStore *client* (``_torchelastic_use_agent_store`` in
    ``torch/distributed/rendezvous.py``): nobody serves SGLang's store and the start hangs until
    its timeout.

    On exit (also when the constructor raises) they come back exactly as they were, absent ones
    absent, and so do the ``CUDA_*``, ``NCCL_*`` and ``TORCH_NCCL_*`` variables: SGLang's engine
    start (``_set_envs_and_config``) runs in the caller's process and overwrites
    ``CUDA_DEVICE_MAX_CONNECTIONS`` (Megatron wants 1), ``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE``
    and ``TORCH_NCCL_AVOID_RECORD_STREAMS`` for its own workers. Those are started by the time the
    constructor returns, so the trainer's values hold for everything the trainer creates later
    (NCCL communicators, subprocesses). Other variables, SGLang's signal handlers and its
    multiprocessing start method are left as SGLang set them: its shutdown path needs them.
    """

    def managed(key: str) -> bool:
        return key.startswith(_TRAINER_ENV_PREFIXES) or _is_launcher_variable(key)

    before = {k: v for k, v in os.environ.items() if managed(k)}
    hidden = sorted(k for k in before if _is_launcher_variable(k))
    for key in hidden:
        del os.environ[key]
    if hidden:
        logger.info("sglang engine: starting without torchrun's %s (its schedulers run their own process group)",
                    ", ".join(hidden))
    try:
        yield
    finally:
        changed = []
        for key in [k for k in os.environ if managed(k) and k not in before]:
            changed.append(key)
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                if key not in hidden:
                    changed.append(key)
                os.environ[key] = value
        if changed:
            logger.info("sglang engine: restored the trainer's %s after the engine started", ", ".join(sorted(changed)))

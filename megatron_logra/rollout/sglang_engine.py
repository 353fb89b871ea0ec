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
(:func:`~megatron_logra.rollout.sglang_env.engine_start_environment`), and the trainer's environment is
restored once it has started. How the engine is reached or started from the config is in
:mod:`megatron_logra.rollout.sglang_launch`; the start-up checks (vocabulary, dtype) in
:mod:`megatron_logra.rollout.sglang_checks`.

Errors on the driving rank (a rejected delta, an HTTP failure) are re-raised on every rank of the
group with the same type (``SyncError`` keeps its ``kind``), so ``PolicySync``'s fallback to a full
refit runs on all ranks together. SGLang is imported lazily (:func:`~megatron_logra.rollout.sglang_api.require_sglang`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch

from megatron_logra.rollout.driver import is_driver, share_from_driver
from megatron_logra.rollout.engine import Rollout, SamplingParams
from megatron_logra.rollout.sglang_api import build_generate_payload, check_logprob_convention, parse_generate_response
from megatron_logra.rollout.sglang_checks import check_engine_vocab, engine_dtype_mismatch
from megatron_logra.rollout.sglang_launch import engine_arguments

logger = logging.getLogger(__name__)

__all__ = ["SGLangEngine"]


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
    attention), on every rank, before the first update instead of at every one. ``trainer_dtype``
    (``model.params_dtype``): an engine whose loader reports weights in another dtype (a server started with
    another ``--dtype``) is named in a warning (:func:`~megatron_logra.rollout.sglang_checks.engine_dtype_mismatch`).
    """

    def __init__(self, *, generate_fn: Optional[Callable[[dict], Any]], target: Any, vocab_size: int,
                 padded_vocab_size: int, gen_group: Any = None, sync_group: Any = None, send_seed: bool = False,
                 close_fn: Optional[Callable[[], None]] = None, deltas: bool = True,
                 trainer_dtype: Optional[str] = None) -> None:
        if is_driver(gen_group) and generate_fn is None:
            raise ValueError("the generation driver (rank 0 of gen_group) needs generate_fn")
        if is_driver(sync_group) and target is None:
            raise ValueError("the sync driver (rank 0 of sync_group) needs a sglang_client target")
        self.generate_fn, self.target = generate_fn, target
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.gen_group, self.sync_group, self.send_seed = gen_group, sync_group, send_seed
        self._close_fn = close_fn
        def start() -> tuple[int, Optional[int], Optional[str]]:
            check = getattr(self.target, "check_delta_sync", None)
            if deltas and callable(check):
                check()
            return (int(self.target.weight_version), getattr(self.target, "vocab_size", None),
                    getattr(self.target, "weight_dtype", None))

        version, engine_vocab, self.engine_dtype = share_from_driver(start, sync_group)
        self._version = int(version)
        self.engine_vocab_size = check_engine_vocab(engine_vocab, vocab_size, padded_vocab_size)
        mismatch = engine_dtype_mismatch(self.engine_dtype, trainer_dtype)
        if mismatch and is_driver(sync_group):
            logger.warning("sglang engine: %s", mismatch)

    # ------------------------------------------------------------------ weights (sync_client, driver only)

    @property
    def weight_version(self) -> int:
        """Version of the engine's weights, shared from the sync driver after every update: the version it
        reached, or after a failed one the version read back from the engine (:meth:`_read_back_version`),
        -1 (unknown: deltas are refused until a full refit) when it cannot be read."""
        return self._version

    @property
    def receives_weights(self) -> bool:
        """True on the sync driver only: the one rank whose payloads reach SGLang. Other ranks take
        part in every weight call (pass ``None`` as the delta) without building payloads."""
        return is_driver(self.sync_group)

    def _synced(self, fn: Callable[[], Any]) -> Any:
        """Run the update ``fn`` on the sync driver; every rank gets its result and the engine's new version,
        or its error and the version read back from the engine (a second collective: the error reached every
        rank, so every rank takes part)."""
        try:
            result, self._version = share_from_driver(lambda: (fn(), int(self.target.weight_version)),
                                                      self.sync_group)
        except Exception:
            self._version = share_from_driver(self._read_back_version, self.sync_group)
            raise
        return result

    def _read_back_version(self) -> int:
        """The engine's version after a failed update (driver): read from the engine itself (the target's
        ``refresh()``, which reads the loader's record back; a target without one: its ``weight_version``),
        or -1 (unknown) when it cannot be read. Never raises."""
        try:
            refresh = getattr(self.target, "refresh", None)
            return int(refresh() if callable(refresh) else self.target.weight_version)
        except Exception as exc:  # noqa: BLE001 - the update's own error is the one raised
            logger.warning("sglang engine: cannot read its weight version back after a failed update (%s); "
                           "treating it as unknown (-1) until a full refit", exc)
            return -1

    def apply_sketch_delta(self, delta: Any) -> int:
        """Send one sketch delta through ``sglang_client`` (driver; other ranks' ``delta`` is unused and
        may be None); every rank gets the new version or the same error (``SyncError`` for a delta the
        engine or the client refused). After an error :attr:`weight_version` is the version read back
        from the engine: the one it kept when it refused the delta before any write, -1 when its commit
        failed after a first write, the new one when only the answer was lost; -1 when it cannot be read.
        ``delta`` may be a zero-argument callable that builds it: the driver calls it inside
        the shared outcome, so a failure while building reaches every rank too."""
        self._synced(lambda: self.target.apply_sketch_delta(delta() if callable(delta) else delta))
        return self._version

    def update_weights_full(self, hf_state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Dense refit (HF names, full tensors) through ``sglang_client``; then ``weight_version = version``
        (after a failure: the version read back from the engine, -1 for a refit that stopped part-way).

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
        ``model.params_dtype``, which must be bfloat16 or float16:
        :func:`~megatron_logra.rollout.sglang_checks.check_engine_dtype`). Sketch deltas
        are expected (``deltas``, see the class) when ``sync.mode=delta`` and ``optimizer.name=logra``.
        Built from :func:`~megatron_logra.rollout.sglang_launch.engine_arguments` (a collective)."""
        return cls(**engine_arguments(cfg, groups))

"""The engine protocol both SGLang targets share (``_SGLangTarget``), built on five transport primitives.

Contract: a transport (:mod:`~megatron_logra.sync.sglang_client`) implements ``_server_info``,
``_update`` (``update_weights_from_tensor``), ``_read_param`` (``get_weights_by_name``),
``_pause`` and ``_continue`` (and may implement ``_publish_version``); this class turns them into
the engine protocol (``weight_version``, ``apply_sketch_delta``, ``update_weights_full``,
``reset_version``, ``fingerprint``), keeps the version bookkeeping and the byte/time counters,
checks the server registers the loader, and pauses generation around updates.

How a delta travels (checked against SGLang's source, see the module README in the report):

1. the server must list :data:`~megatron_logra.sync.sglang_loader.LOADER_PATH` in
   ``--custom-weight-loader`` (``ServerArgs.custom_weight_loader``); the client checks this in
   ``get_server_info`` / ``engine.server_args`` *before* sending anything, because SGLang raises
   ``NotImplementedError("Unknown load_format")`` inside the scheduler for an unregistered
   loader, which kills the server;
2. the delta bytes go as one uint8 tensor (plus a small JSON command tensor with a nonce)
   through ``update_weights_from_tensor(named_tensors, load_format=LOADER_PATH,
   flush_cache=True)``; SGLang deserializes them on every TP rank and calls
   ``sync_loader(model, named_tensors)``;
3. SGLang reports success whatever the loader decided (the loader must not raise, see
   :mod:`~megatron_logra.sync.sglang_loader`), so the client reads the loader's recorded outcome
   back with ``get_weights_by_name(STATE_PARAM)`` and checks its nonce, ``ok`` and version;
   a rejection raises :class:`SyncError` with the engine's reason and the version is kept.

Data parallelism (``--dp-size N > 1``): SGLang accepts ``update_weights_from_tensor`` only with
``--enable-dp-attention`` (its tokenizer manager asserts ``dp_size == 1 or enable_dp_attention``),
so a server that reports ``dp_size > 1`` with ``enable_dp_attention`` false is refused before
anything is sent (``config``). With it the engine is not N copies of the model but one model over
its ``tp_size`` GPUs: attention is split over groups of ``tp_size / N`` ranks (``attn_tp``), the
embedding is unsharded, the MLP and ``lm_head`` span all ``tp_size`` ranks. The loader assumes one
TP position for the whole model, so no delta could apply: :meth:`_SGLangTarget.check_delta_sync`
refuses deltas before anything is sent (``config``: serve with ``--dp-size 1``, or set
``sync.mode=full``) and fingerprints are off (``None``). Dense refits go through SGLang's own
``load_weights``, which knows that layout. Their loader commands (version marks, status) run on
every rank, and ``get_weights_by_name`` answers once per data-parallel rank
(``TokenizerManager.get_weights_by_name``: the bare answer at ``dp_size == 1``, the list of
answers otherwise). The client decodes every rank's record: the loader states must agree (nonce,
op, ok, error kind, version, vocabulary, fingerprint version), else :class:`SGLangError`
``engine`` names the data-parallel ranks and what differs -- one that missed an update is never
hidden behind the first one; a full refit, which reaches every rank, brings them back together.
Only the first read of :attr:`_SGLangTarget.weight_version` tolerates disagreeing ranks: it
reports version -1 (unknown) so an engine left in that state can still be refit.

Pipeline parallelism (``--pp-size N > 1``): each stage holds only its own layers (SGLang builds the
others, and ``norm``/``lm_head`` before the last stage, as parameterless ``PPMissingLayer`` modules), while
every rank receives the whole delta and must find every target it names, so
:meth:`_SGLangTarget.check_delta_sync` refuses deltas before anything is sent (``config``: set
``sync.mode=full``, or serve the model with ``--pp-size 1``) and fingerprints are off (``None``).
Dense refits are not refused: they go through SGLang's own ``load_weights``, which loads each stage's
layers.

``fingerprint()`` asks the engine's loader to hash its weights in HF layout (at any TP size:
the engine's ranks assemble the sampled rows over their TP group, so the result equals the
TP=1 fingerprint); it returns ``None`` when the engine cannot (pipeline stages or data-parallel
ranks, see above; the loader reported a ``fingerprint_error``; or the served model class has no
``get_weights_by_name``): drift checks are then skipped for that engine, and only the periodic
anchor refit protects against silent drift. Imports only torch and the standard library
besides the sync package.

Vocabulary: the trainer pads its vocabulary (``ModelConfig.padded_vocab_size``); the served model
may not (a server started from the Hugging Face checkpoint or the exported config has the
tokenizer's ``vocab_size``). SGLang's ``VocabParallelEmbedding.weight_loader`` asserts that a
loaded ``embed_tokens``/``lm_head`` has exactly ``org_vocab_size`` rows, so refits and the dense
vocabulary entries of deltas are cut to the engine's vocabulary (:attr:`_SGLangTarget.vocab_size`,
which the loader reports): the rows past it are padding the trainer masks, which the engine does
not have. A tensor with *fewer* rows than the engine's vocabulary is refused before it is sent.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Any, Iterable, Iterator, Mapping, Optional, Union

import torch

from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.sglang_weights import VOCAB_PARALLEL
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.sglang_payloads import (
    DEFAULT_CHUNK_BYTES,
    SGLangError,
    _decode_json_param,
    _precheck,
    _replica_answers,
    chunk_named_tensors,
)
from megatron_logra.sync.sglang_wire import (
    FINGERPRINT_PARAM,
    LOADER_PATH,
    STATE_PARAM,
    command_as_named_tensors,
    delta_as_named_tensors,
)

logger = logging.getLogger(__name__)

_REPLICA_KEYS = ("format", "nonce", "op", "ok", "error_kind", "version", "vocab_size", "fingerprint_version")
"""The loader-state fields every data-parallel rank must report alike."""


def _int_at_least_1(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


# --------------------------------------------------------------------------- the shared protocol


class _SGLangTarget:
    """The engine protocol on top of five primitives each transport implements."""

    def __init__(self, *, pause: bool = True, fingerprint_on_apply: bool = True, rows_per_tensor: int = 4,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.pause = pause
        self.fingerprint_on_apply = fingerprint_on_apply
        self.rows_per_tensor = rows_per_tensor
        self.chunk_bytes = chunk_bytes
        self._version: Optional[int] = None
        self._vocab: Optional[int] = None
        self._vocab_read = False
        self._checked = False
        self._dp_size: Optional[int] = None
        self._pp_size: Optional[int] = None
        self._fp_disabled: Optional[str] = None
        self.bytes_sent = 0
        self.num_deltas = 0
        self.num_full = 0
        self.last_apply_s = 0.0
        self.last_full_s = 0.0

    # ---- primitives (transport specific) ------------------------------------------------
    def _server_info(self) -> dict:
        """The server's arguments that matter here: ``custom_weight_loader``, ``tp_size``, ``dp_size``,
        ``enable_dp_attention``, ``pp_size`` (absent keys: not known)."""
        raise NotImplementedError

    def _update(self, named_tensors: list[tuple[str, torch.Tensor]], load_format: Optional[str],
                flush_cache: bool) -> tuple[bool, str]:
        raise NotImplementedError

    def _read_param(self, name: str) -> Optional[list]:
        """SGLang's ``get_weights_by_name`` answer as it comes (at ``dp_size > 1`` one list per
        data-parallel replica), None when the engine has no such parameter."""
        raise NotImplementedError

    def _pause(self) -> None:
        raise NotImplementedError

    def _continue(self) -> None:
        raise NotImplementedError

    def _publish_version(self, version: int) -> None:
        """Tell SGLang's own ``weight_version`` (tags generations); best effort."""

    # ---- helpers --------------------------------------------------------------------------
    def _check_server(self) -> None:
        if self._checked:
            return
        info = self._server_info()
        loaders = info.get("custom_weight_loader") or []  # SGLang's default is None / []
        if "custom_weight_loader" not in info:
            logger.warning("SGLang server info has no 'custom_weight_loader' field; assuming %s is registered",
                           LOADER_PATH)
        elif LOADER_PATH not in loaders:
            raise SGLangError("config", f"the SGLang engine does not register the sketch-delta loader: start it with "
                                        f"--custom-weight-loader {LOADER_PATH} (it lists {loaders or []}); sending "
                                        "an unregistered load_format would crash its scheduler")
        dp_size = _int_at_least_1(info.get("dp_size"))
        if dp_size > 1 and info.get("enable_dp_attention") is False:
            raise SGLangError("config", f"the SGLang engine serves dp_size={dp_size} data-parallel replicas without "
                                        "--enable-dp-attention, and SGLang then refuses update_weights_from_tensor "
                                        "(its tokenizer manager asserts dp_size == 1 or enable_dp_attention): start "
                                        "it with --dp-size 1, or add --enable-dp-attention for dense refits only "
                                        "(sync.mode=full)")
        self._dp_size = dp_size
        self._pp_size = _int_at_least_1(info.get("pp_size"))
        if self._pp_size > 1 and not self._fp_disabled:
            self._fp_disabled = (f"the engine runs {self._pp_size} pipeline stages, each holding only its own "
                                 "layers, so its loader cannot hash the whole model")
        if dp_size > 1 and not self._fp_disabled:
            self._fp_disabled = (f"the engine runs dp_size={dp_size} with data-parallel attention, a layout the "
                                 "loader cannot read in HF order")
        self._checked = True

    def check_delta_sync(self) -> None:
        """Refuse (:class:`SGLangError` ``config``, before anything but the server info is read) an engine
        that cannot apply sketch deltas: one with pipeline stages (``pp_size > 1``: each stage holds only
        its own layers, while every rank receives the whole delta and needs every target it names), or
        with data-parallel ranks (``dp_size > 1``, which SGLang updates only with data-parallel attention:
        attention and MLP are then split over different TP groups, and the loader assumes one TP position
        per model; see the module docstring). Dense refits (:meth:`update_weights_full`) stay available:
        they go through SGLang's own ``load_weights``."""
        self._check_server()
        if self._pp_size is not None and self._pp_size > 1:
            raise SGLangError("config", f"the SGLang engine runs pp_size={self._pp_size} pipeline stages: each stage "
                                        "holds only its own layers, so sketch deltas (which every rank applies "
                                        "whole) cannot apply; set sync.mode=full (dense refits), or serve the "
                                        "model without pipeline parallelism (--pp-size 1)")
        if self._dp_size is not None and self._dp_size > 1:
            raise SGLangError("config", f"the SGLang engine runs dp_size={self._dp_size} with data-parallel attention: "
                                        "its attention is split over tp_size/dp_size ranks while its MLP spans all "
                                        "tp_size, a layout sketch deltas cannot be applied to; serve the model with "
                                        "--dp-size 1 (the in-process engine, rl.rollout.sglang_url empty, runs one "
                                        "engine per trainer data-parallel replica), or set sync.mode=full (dense "
                                        "refits reach every data-parallel rank)")

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        if not self.pause:
            yield
            return
        self._pause()
        try:
            yield
        finally:
            self._continue()

    def _command(self, op: str, *, flush_cache: bool = False, strict: bool = True, **fields: Any) -> dict:
        """Run one loader command and return its verified state (``strict``: see :meth:`_merge_states`)."""
        nonce = secrets.token_hex(8)
        command = {"op": op, "nonce": nonce, "rows_per_tensor": self.rows_per_tensor, **fields}
        self._send(command_as_named_tensors(command), flush_cache=flush_cache, what=f"command {op!r}")
        return self._state(nonce, strict=strict)

    def _send(self, named_tensors: list, *, flush_cache: bool, what: str) -> None:
        ok, message = self._update(named_tensors, LOADER_PATH, flush_cache)
        if not ok:
            raise SGLangError("engine", f"SGLang update_weights_from_tensor failed for {what}: {message}")

    def _read_records(self, name: str, what: str) -> Optional[list[Optional[dict]]]:
        """The JSON record ``name`` of every data-parallel replica (one entry at ``dp_size == 1``; None
        for a replica without one); None when no replica has it."""
        answers = _replica_answers(self._read_param(name), self._dp_size, what)
        if answers is None:
            return None
        if len(answers) == 1:
            return [_decode_json_param(answers[0], what)]
        return [None if a is None else _decode_json_param(a, f"{what} of data-parallel replica {i}")
                for i, a in enumerate(answers)]

    def _merge_states(self, records: list[Optional[dict]], what: str, *, strict: bool = True) -> dict:
        """One loader state from every data-parallel replica's (:data:`_REPLICA_KEYS` must agree).

        Disagreeing replicas raise :class:`SGLangError` ``engine`` naming them and the differing
        fields; with ``strict=False`` the state reports version -1 (unknown) instead, unless the
        replicas disagree on the vocabulary (always an error). Differing ``error`` /
        ``fingerprint_error`` texts are joined per replica.
        """
        if len(records) == 1 and records[0] is not None:
            return records[0]
        n = len(records)
        missing = [i for i, r in enumerate(records) if r is None]
        present = [r for r in records if r is not None]
        diffs = [f"replica(s) {missing} have no {what}"] if missing else []
        vocab_differs = False
        for key in _REPLICA_KEYS:
            values = [r.get(key) for r in present]
            if any(v != values[0] for v in values):
                vocab_differs = vocab_differs or key == "vocab_size"
                diffs.append(f"{key}: " + ", ".join(f"replica {i}={r.get(key)!r}"
                                                    for i, r in enumerate(records) if r is not None))
        if diffs and (strict or vocab_differs or not present):
            raise SGLangError("engine", f"the SGLang engine's {n} data-parallel replicas disagree on the {what}: "
                                        f"{'; '.join(diffs)} -- a replica did not apply the same updates as the "
                                        "others; a full refit (update_weights_full) reaches every replica")
        state = dict(present[0])
        for key in ("error", "fingerprint_error"):
            texts = [(i, r.get(key)) for i, r in enumerate(records) if r is not None and r.get(key)]
            if len({t for _, t in texts}) > 1:
                state[key] = "; ".join(f"data-parallel replica {i}: {t}" for i, t in texts)
            elif texts:
                state[key] = texts[0][1]
        if diffs:
            logger.warning("SGLang engine's data-parallel replicas disagree (%s): its version is unknown until a "
                           "full refit", "; ".join(diffs))
            state.update(version=-1, fingerprint_version=None)
        return state

    def _state(self, nonce: Optional[str] = None, *, strict: bool = True) -> dict:
        records = self._read_records(STATE_PARAM, f"loader state {STATE_PARAM!r}")
        if records is None:
            raise SGLangError("engine", f"cannot read the loader state {STATE_PARAM!r} back with get_weights_by_name "
                                        "after the loader ran: check the engine's log for the read error (the "
                                        "loader serves the record itself on model classes without the method)")
        if nonce is not None and not strict:  # every replica ran this command, whatever else differs
            for i, r in enumerate(records):
                if r is None or r.get("nonce") != nonce:
                    where = f" on data-parallel replica {i}" if len(records) > 1 else ""
                    raise SGLangError("engine", f"the loader did not record this request{where} (state nonce "
                                                f"{r and r.get('nonce')!r}, sent {nonce!r}): was {LOADER_PATH} "
                                                "really called?")
        state = self._merge_states(records, f"loader state {STATE_PARAM!r}", strict=strict)
        self._note_vocab(state)
        if nonce is not None and state.get("nonce") != nonce:
            raise SGLangError("engine", f"the loader did not record this request (state nonce {state.get('nonce')!r}, "
                                        f"sent {nonce!r}): was {LOADER_PATH} really called?")
        return state

    def refresh(self) -> int:
        """Check the server and read the engine's version from its loader state (runs a status command
        when some replica has none yet). Data-parallel replicas that disagree raise :class:`SGLangError`."""
        return self._read_version(strict=True)

    def _read_version(self, *, strict: bool) -> int:
        self._check_server()
        records = self._read_records(STATE_PARAM, "loader state")
        if records is None or any(r is None for r in records):
            state = self._command("status", strict=strict)
        else:
            state = self._merge_states(records, "loader state", strict=strict)
        self._note_vocab(state)
        self._version = int(state["version"])
        return self._version

    def _note_vocab(self, state: dict) -> None:
        size = state.get("vocab_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            self._vocab, self._vocab_read = size, True

    @property
    def vocab_size(self) -> Optional[int]:
        """The served model's vocabulary (``config.vocab_size``, as the loader reports it; one status
        command the first time), None when the engine's loader does not say. Refits and deltas send
        ``embed_tokens``/``lm_head`` cut to this many rows."""
        if not self._vocab_read:
            self._check_server()
            self._vocab_read = True
            self._command("status", strict=False)  # a full refit reads it: replicas may be at different versions
        return self._vocab

    def _vocab_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the engine loads it: a vocab-parallel tensor cut to the engine's vocabulary."""
        vocab = self._vocab
        if name not in VOCAB_PARALLEL or vocab is None or tensor.dim() < 1 or tensor.shape[0] == vocab:
            return tensor
        if tensor.shape[0] < vocab:
            raise SGLangError("config", f"{name} has {tensor.shape[0]} rows but the SGLang engine's model has "
                                        f"vocab_size={vocab}: the trainer's vocabulary (model.vocab_size, padded "
                                        "by model.make_vocab_size_divisible_by) must cover the served model's")
        return tensor[:vocab]  # the trainer's padding rows: masked there, absent from the engine's model

    def _delta_for_engine(self, delta: SketchDelta, data: bytes) -> tuple[SketchDelta, bytes]:
        """``delta`` with its dense vocabulary entries cut to the engine's vocabulary (re-encoded if cut)."""
        if not any(name in VOCAB_PARALLEL for name in delta.dense):
            return delta, data
        self.vocab_size  # noqa: B018 - reads the engine's vocabulary once
        dense = {name: self._vocab_rows(name, t) for name, t in delta.dense.items()}
        if all(dense[name] is t for name, t in delta.dense.items()):
            return delta, data
        delta.dense = {name: t.clone() for name, t in dense.items()}
        return delta, encode(delta)

    # ---- the protocol ----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The engine's weight version (read from the engine on first use, then tracked). Data-parallel
        replicas that disagree read as -1 (unknown: deltas are refused until a full refit), with a warning."""
        if self._version is None:
            self._read_version(strict=False)
        return int(self._version)  # type: ignore[arg-type]

    def apply_sketch_delta(self, payload: Union[SketchDelta, bytes, bytearray, memoryview]) -> int:
        """Send one delta; returns the new version. Raises :class:`SyncError` (version kept) on rejection,
        and :class:`SGLangError` ``config`` before sending anything to an engine :meth:`check_delta_sync`
        refuses."""
        data = encode(payload) if isinstance(payload, SketchDelta) else bytes(payload)
        delta = decode(data)  # checksum and structure, before anything is sent
        self.check_delta_sync()
        current = self.refresh()
        delta, data = self._delta_for_engine(delta, data)  # the engine's own version: someone may have refit or restarted it
        try:
            _precheck(delta, current)
        except SyncError as exc:
            hint = (" -- a TP rank failed mid-apply earlier, so the engine needs a full refit (update_weights_full)"
                    if current < 0 else "")
            raise SyncError(exc.kind, f"not sent to SGLang: {exc} (engine at version {current}){hint}") from None
        nonce = secrets.token_hex(8)
        command = {"op": "apply", "nonce": nonce, "rows_per_tensor": self.rows_per_tensor,
                   "fingerprint": bool(self.fingerprint_on_apply and not self._fp_disabled)}
        t0 = time.perf_counter()
        with self._paused():
            self._send(delta_as_named_tensors(data) + command_as_named_tensors(command), flush_cache=True,
                       what=f"delta {delta.base_version}->{delta.new_version}")
            state = self._state(nonce)
        self.last_apply_s = time.perf_counter() - t0
        self._version = int(state["version"])
        if state.get("fingerprint_error") and not self._fp_disabled:
            self._fp_disabled = state["fingerprint_error"]
            logger.warning("SGLang engine cannot fingerprint its weights (%s): drift checks are skipped",
                           self._fp_disabled)
        if not state.get("ok"):
            raise SyncError(state.get("error_kind") or "rejected",
                            f"SGLang engine rejected delta {delta.base_version}->{delta.new_version}: "
                            f"{state.get('error')} (engine at version {self._version})")
        if self._version != delta.new_version:
            raise SGLangError("engine", f"engine reports version {self._version} after delta "
                                        f"{delta.base_version}->{delta.new_version}")
        self.bytes_sent += len(data)
        self.num_deltas += 1
        self._publish_version(self._version)
        return self._version

    def update_weights_full(self, hf_state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Dense refit of ``hf_state`` (HF names, full tensors; a mapping or a stream of pairs) in
        ``chunk_bytes`` chunks; then version := ``version``.

        Goes through SGLang's default loader (``load_format=None`` -> ``model.load_weights``, which
        fuses q/k/v and gate/up and shards for TP); ``embed_tokens``/``lm_head`` go cut to the engine's
        vocabulary (:attr:`vocab_size`). The engine's version is -1 (unknown) from the
        first chunk until the last one has loaded, so a failure part-way leaves it refusing deltas
        until the next full refit succeeds. Names must be the checkpoint's: SGLang's ``load_weights``
        treats an unknown one by model class (``Qwen2ForCausalLM`` raises inside the scheduler, which
        stops the server; ``LlamaForCausalLM`` logs it and skips the tensor, which only the next drift
        check would catch).
        """
        self._check_server()
        self.vocab_size  # noqa: B018 - known before the first chunk: vocabulary tensors are cut to it
        t0 = time.perf_counter()
        sent = 0
        named = ((name, self._vocab_rows(name, t))
                 for name, t in (((k, hf_state[k]) for k in sorted(hf_state)) if isinstance(hf_state, Mapping)
                                 else hf_state))
        with self._paused():
            # the engine's weights are a mix of two versions until the last chunk: say so first, so a
            # refit that stops part-way leaves version -1 (unknown) and every delta is refused
            state = self._command("set_version", version=-1)
            self._version = int(state["version"])
            if not state.get("ok") or self._version != -1:
                raise SGLangError("engine", f"marking the engine version unknown before the refit failed: "
                                            f"{state.get('error')}")
            for chunk in chunk_named_tensors(named, self.chunk_bytes):
                ok, message = self._update(chunk, None, False)
                if not ok:
                    raise SGLangError("engine", f"full refit to version {version} failed at {chunk[0][0]}: {message}")
                sent += sum(t.numel() * t.element_size() for _, t in chunk)
            state = self._command("set_version", flush_cache=True, version=int(version),
                                  fingerprint=bool(self.fingerprint_on_apply and not self._fp_disabled))
        if not state.get("ok"):
            raise SGLangError("engine", f"setting version {version} after the refit failed: {state.get('error')}")
        self._version = int(state["version"])
        self.last_full_s = time.perf_counter() - t0
        self.bytes_sent += sent
        self.num_full += 1
        self._publish_version(self._version)

    def reset_version(self, version: int) -> None:
        """Set the engine's version after weights were loaded outside the delta chain."""
        self._check_server()
        state = self._command("set_version", version=int(version))
        if not state.get("ok"):
            raise SGLangError("engine", f"set_version {version} failed: {state.get('error')}")
        self._version = int(state["version"])

    def fingerprint(self) -> Optional[dict[str, str]]:
        """``{HF name: "<sha256 hex>@<version>"}`` of the engine's weights, rows sampled with its weight version
        as the salt (``sync.fingerprint.fingerprint_salt`` reads it back), or None when it cannot say (see module docstring;
        always None at ``pp_size > 1`` or ``dp_size > 1``). A record for another version than the engine's
        raises :class:`SGLangError` ``engine``."""
        self._check_server()
        if self._fp_disabled:
            return None
        current = self.weight_version

        def stale(records: Optional[list[Optional[dict]]]) -> bool:
            return records is None or any(r is None or r.get("version") != current for r in records)

        records = self._read_records(FINGERPRINT_PARAM, "engine fingerprint")
        if stale(records):
            state = self._command("fingerprint")
            if state.get("fingerprint_error"):
                self._fp_disabled = state["fingerprint_error"]
                logger.warning("SGLang engine cannot fingerprint its weights (%s): drift checks are skipped",
                               self._fp_disabled)
                return None
            records = self._read_records(FINGERPRINT_PARAM, "engine fingerprint")
        if stale(records):
            versions = ", ".join(str(r and r.get("version")) for r in records or [None])
            raise SGLangError("engine", f"engine fingerprint is for version {versions}, engine at {current}")
        return dict(records[0]["fingerprint"])  # type: ignore[index]

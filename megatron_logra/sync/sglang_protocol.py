"""The engine protocol both SGLang targets share (``_SGLangTarget``), built on five transport primitives.

Contract: a transport (:mod:`~megatron_logra.sync.sglang_client`) implements the primitives
:class:`~megatron_logra.sync.sglang_primitives._SGLangPrimitives` declares (``_server_info``,
``_update``, ``_read_param``, ``_pause``, ``_continue``, optionally ``_publish_version``); this
class turns them into the engine protocol (``weight_version``, ``apply_sketch_delta``,
``update_weights_full``, ``reset_version``, ``fingerprint``), keeps the version bookkeeping and the
byte/time counters, checks the server registers the loader, and pauses generation around updates.
The server checks (data-parallel and pipeline layouts) are
:mod:`~megatron_logra.sync.sglang_primitives`'s; the loader commands, the read-back of their
outcome across data-parallel ranks and the vocabulary cut are
:mod:`~megatron_logra.sync.sglang_state`'s.

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

``fingerprint()`` asks the engine's loader to hash its weights in HF layout (at any TP size:
the engine's ranks assemble the sampled rows over their TP group, so the result equals the
TP=1 fingerprint); it returns ``None`` when the engine cannot (pipeline stages or data-parallel
ranks, see :mod:`~megatron_logra.sync.sglang_primitives`; the loader reported a
``fingerprint_error``; or the served model class has no ``get_weights_by_name``): drift checks are
then skipped for that engine, and only the periodic anchor refit protects against silent drift.
Imports only torch and the standard library besides the sync package.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Iterable, Mapping, Optional, Union

import torch

from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.sglang_payloads import SGLangError, _precheck, chunk_named_tensors
from megatron_logra.sync.sglang_state import _SGLangLoaderState
from megatron_logra.sync.sglang_wire import FINGERPRINT_PARAM, command_as_named_tensors, delta_as_named_tensors

logger = logging.getLogger(__name__)


class _SGLangTarget(_SGLangLoaderState):
    """The engine protocol on top of five primitives each transport implements."""

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

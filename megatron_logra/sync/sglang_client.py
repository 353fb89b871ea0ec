"""Trainer-side clients that push sketch deltas to SGLang (in-process ``sglang.Engine`` or an HTTP server).

Both targets speak the engine protocol :class:`megatron_logra.rl.policy_sync.PolicySync` uses::

    target.weight_version                    # int: the version the engine's weights are at
    target.apply_sketch_delta(payload)       # encoded delta (or SketchDelta) -> new version
    target.update_weights_full(hf_state, v)  # dense refit under HF names, then version := v
    target.fingerprint()                     # {HF name: sha256} of the engine weights, or None

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

Generation is paused around updates when the engine can pause (HTTP ``/pause_generation`` and
``/continue_generation``; SGLang's default pause mode aborts in-flight requests, and the
cache flush after a weight update asserts that nothing is running). Without a pause, SGLang
still serialises the update behind in-flight requests (its model-update writer lock).

HTTP payloads: ``serialized_named_tensors`` is a list with one base64 string per engine TP
rank (each scheduler reads entry ``tp_rank``). ``serialization="pickle"`` (default) pickles
CPU tensors by value (``torch._utils._rebuild_tensor_v2`` + ``torch.storage._load_from_bytes``,
both inside SGLang's unpickling allow-list), so it works with a server on another host at the
cost of shipping the bytes (x4/3 for base64, x TP size). ``serialization="cuda_ipc"`` sends
CUDA tensors as IPC handles (``torch.multiprocessing`` reductions, as SGLang's own
``MultiprocessingSerializer`` does): zero-copy, but only for a server on the same host and
GPU(s), and the tensors must stay alive until the request returns (they do: calls are
synchronous). CPU tensors cannot use IPC (their shared-memory handles need the sender's
multiprocessing authkey, which an independently started server does not have).

``fingerprint()`` asks the engine's loader to hash its weights in HF layout (TP=1 engines
only); it returns ``None`` when the engine cannot (TP > 1, or the served model class has no
``get_weights_by_name``): drift checks are then skipped for that engine, and only the periodic
anchor refit protects against silent drift. Imports only torch, safetensors (via the codec) and
the standard library; SGLang is imported lazily and only for ``serialization="cuda_ipc"``.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import pickle
import secrets
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from megatron_logra.sync.apply import check_version
from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import off_grid_rows
from megatron_logra.sync.sglang_loader import (
    FINGERPRINT_PARAM,
    LOADER_PATH,
    STATE_PARAM,
    bytes_from_values,
    command_as_named_tensors,
    delta_as_named_tensors,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SGLangError", "SGLangEngineTarget", "SGLangServerTarget", "serialize_named_tensors", "chunk_named_tensors",
    "LOADER_PATH", "SERIALIZATIONS",
]

SERIALIZATIONS = ("pickle", "cuda_ipc")
DEFAULT_CHUNK_BYTES = 512 << 20
_READ_ALL = 1 << 31  # truncate_size for get_weights_by_name: the whole (1-D) state parameter


class SGLangError(SyncError):
    """A failure talking to SGLang: ``kind`` is ``unreachable``, ``auth``, ``http``, ``config`` or ``engine``.

    ``status`` is the HTTP status (None when there was no response), ``body`` the decoded response.
    """

    def __init__(self, kind: str, message: str, *, status: Optional[int] = None, body: Any = None) -> None:
        super().__init__(kind, message)
        self.status = status
        self.body = body


# --------------------------------------------------------------------------- payloads


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached and contiguous, cloned when it is a view of a larger storage (pickle ships whole storages)."""
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]], serialization: str = "pickle") -> str:
    """One base64 entry of ``serialized_named_tensors`` for SGLang's HTTP ``/update_weights_from_tensor``.

    ``pickle``: CPU copies pickled by value (any host). ``cuda_ipc``: CUDA tensors as IPC handles
    via ``torch.multiprocessing``'s reductions (same host only); SGLang's serializer is used when
    importable (it encodes the device by UUID), else a ``ForkingPickler`` with torch's reductions.
    """
    if serialization == "pickle":
        obj = [(name, _compact(t.cpu())) for name, t in named_tensors]
        return base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
    if serialization == "cuda_ipc":
        obj = []
        for name, t in named_tensors:
            if not t.is_cuda:
                raise SyncError("config", f"serialization='cuda_ipc' needs CUDA tensors; {name} is on {t.device}")
            obj.append((name, t.detach().contiguous()))
        try:  # pragma: no cover - needs sglang
            from sglang.srt.utils import MultiprocessingSerializer

            return MultiprocessingSerializer.serialize(obj, output_str=True)
        except ImportError:
            from multiprocessing.reduction import ForkingPickler

            import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

            buf = io.BytesIO()
            ForkingPickler(buf).dump(obj)
            return base64.b64encode(buf.getvalue()).decode("ascii")
    raise SyncError("config", f"unknown serialization {serialization!r}; choose one of {SERIALIZATIONS}")


def chunk_named_tensors(state: Mapping[str, torch.Tensor], max_bytes: int = DEFAULT_CHUNK_BYTES,
                        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups of ``(name, tensor)`` of at most ``max_bytes`` each (a larger tensor travels alone), in name order."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name in sorted(state):
        t = state[name]
        n = t.numel() * t.element_size()
        if chunk and size + n > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += n
    if chunk:
        yield chunk


def _precheck(delta: SketchDelta, current_version: int) -> None:
    """The weight-free checks of ``apply.validate``, so a bad delta never reaches (or pauses) the engine."""
    check_version(delta, current_version)
    for t in delta.targets:
        if not bool(torch.isfinite(t.U_OR).all()):
            raise SyncError("nonfinite", f"U of {t.name} has non-finite entries")
        if delta.distribution == "rademacher" and off_grid_rows(t.U_OR):
            raise SyncError("precision", f"U of {t.name} has rows off the exact-sum grid "
                                         "(build it with quantize_factor)")
    for name, v in delta.dense.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise SyncError("nonfinite", f"dense {name} has non-finite entries")


def _decode_json_param(values: Any, what: str) -> dict:
    if not isinstance(values, list):
        raise SGLangError("engine", f"{what}: expected a list of byte values, got {type(values).__name__}")
    try:
        obj = json.loads(bytes_from_values(values))
    except (SyncError, UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise SGLangError("engine", f"{what} does not decode ({exc})") from None
    if not isinstance(obj, dict):
        raise SGLangError("engine", f"{what} is not a JSON object")
    return obj


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
        self._checked = False
        self._fp_disabled: Optional[str] = None
        self.bytes_sent = 0
        self.num_deltas = 0
        self.num_full = 0
        self.last_apply_s = 0.0
        self.last_full_s = 0.0

    # ---- primitives (transport specific) ------------------------------------------------
    def _server_info(self) -> dict:
        raise NotImplementedError

    def _update(self, named_tensors: list[tuple[str, torch.Tensor]], load_format: Optional[str],
                flush_cache: bool) -> tuple[bool, str]:
        raise NotImplementedError

    def _read_param(self, name: str) -> Optional[list]:
        """The parameter's values (``get_weights_by_name``), None when the engine has no such parameter."""
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
        self._checked = True

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

    def _command(self, op: str, *, flush_cache: bool = False, **fields: Any) -> dict:
        """Run one loader command and return its verified state."""
        nonce = secrets.token_hex(8)
        command = {"op": op, "nonce": nonce, "rows_per_tensor": self.rows_per_tensor, **fields}
        self._send(command_as_named_tensors(command), flush_cache=flush_cache, what=f"command {op!r}")
        return self._state(nonce)

    def _send(self, named_tensors: list, *, flush_cache: bool, what: str) -> None:
        ok, message = self._update(named_tensors, LOADER_PATH, flush_cache)
        if not ok:
            raise SGLangError("engine", f"SGLang update_weights_from_tensor failed for {what}: {message}")

    def _state(self, nonce: Optional[str] = None) -> dict:
        values = self._read_param(STATE_PARAM)
        if values is None:
            raise SGLangError("engine", f"cannot read the loader state {STATE_PARAM!r} back: the served model class "
                                        "needs get_weights_by_name (SGLang's Llama/Qwen classes have it)")
        state = _decode_json_param(values, f"loader state {STATE_PARAM!r}")
        if nonce is not None and state.get("nonce") != nonce:
            raise SGLangError("engine", f"the loader did not record this request (state nonce {state.get('nonce')!r}, "
                                        f"sent {nonce!r}): was {LOADER_PATH} really called?")
        return state

    def refresh(self) -> int:
        """Check the server and read the engine's version from its loader state (runs a status command once)."""
        self._check_server()
        values = self._read_param(STATE_PARAM)
        state = self._command("status") if values is None else _decode_json_param(values, "loader state")
        self._version = int(state["version"])
        return self._version

    # ---- the protocol ----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The engine's weight version (read from the engine on first use, then tracked)."""
        if self._version is None:
            self.refresh()
        return int(self._version)  # type: ignore[arg-type]

    def apply_sketch_delta(self, payload: Union[SketchDelta, bytes, bytearray, memoryview]) -> int:
        """Send one delta; returns the new version. Raises :class:`SyncError` (version kept) on rejection."""
        data = encode(payload) if isinstance(payload, SketchDelta) else bytes(payload)
        delta = decode(data)  # checksum and structure, before anything is sent
        current = self.refresh()  # the engine's own version: someone may have refit or restarted it
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

    def update_weights_full(self, hf_state: Mapping[str, torch.Tensor], version: int) -> None:
        """Dense refit of ``hf_state`` (HF names, full tensors) in ``chunk_bytes`` chunks; then version := ``version``.

        Goes through SGLang's default loader (``load_format=None`` -> ``model.load_weights``, which
        fuses q/k/v and gate/up and shards for TP). An unknown name makes SGLang's ``load_weights``
        raise inside the scheduler, so names must be the checkpoint's.
        """
        self._check_server()
        t0 = time.perf_counter()
        sent = 0
        with self._paused():
            for chunk in chunk_named_tensors(hf_state, self.chunk_bytes):
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
        """``{HF name: sha256 hex}`` of the engine's weights, or None when it cannot say (see module docstring)."""
        if self._fp_disabled:
            return None
        current = self.weight_version
        values = self._read_param(FINGERPRINT_PARAM)
        record = None if values is None else _decode_json_param(values, "engine fingerprint")
        if record is None or record.get("version") != current:
            state = self._command("fingerprint")
            if state.get("fingerprint_error"):
                self._fp_disabled = state["fingerprint_error"]
                logger.warning("SGLang engine cannot fingerprint its weights (%s): drift checks are skipped",
                               self._fp_disabled)
                return None
            values = self._read_param(FINGERPRINT_PARAM)
            record = None if values is None else _decode_json_param(values, "engine fingerprint")
        if record is None or record.get("version") != current:
            raise SGLangError("engine", f"engine fingerprint is for version {record and record.get('version')}, "
                                        f"engine at {current}")
        return dict(record["fingerprint"])


def _result(res: Any) -> tuple[bool, str]:
    """``(success, message)`` from whatever SGLang's Engine returned (tuple, dict or output object)."""
    if isinstance(res, tuple) and len(res) >= 2:
        return bool(res[0]), str(res[1])
    if isinstance(res, dict):
        return bool(res.get("success")), str(res.get("message", ""))
    if hasattr(res, "success"):
        return bool(res.success), str(getattr(res, "message", ""))
    return bool(res), ""


# --------------------------------------------------------------------------- in-process engine


class SGLangEngineTarget(_SGLangTarget):
    """An in-process ``sglang.Engine`` (its scheduler runs in a child process; tensors go by shared memory).

    Start the engine with ``custom_weight_loader=[LOADER_PATH]``. ``pause`` uses the engine's
    ``pause_generation``/``continue_generation`` when it has them (the offline Engine usually
    does not; a synchronous caller has nothing in flight anyway).
    """

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine

    def _server_info(self) -> dict:
        args = getattr(self.engine, "server_args", None)
        if args is None:
            return {}
        return {"custom_weight_loader": getattr(args, "custom_weight_loader", None),
                "tp_size": getattr(args, "tp_size", 1)}

    def _update(self, named_tensors, load_format, flush_cache):
        named = [(n, t.detach()) for n, t in named_tensors]
        return _result(self.engine.update_weights_from_tensor(named, load_format=load_format, flush_cache=flush_cache))

    def _read_param(self, name):
        values = self.engine.get_weights_by_name(name, truncate_size=_READ_ALL)
        return values if isinstance(values, list) else None

    def _pause(self):
        fn = getattr(self.engine, "pause_generation", None)
        if callable(fn):
            fn()

    def _continue(self):
        fn = getattr(self.engine, "continue_generation", None)
        if callable(fn):
            fn()


# --------------------------------------------------------------------------- HTTP server


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    text = body if isinstance(body, str) else json.dumps(body)
    return text[:500]


class SGLangServerTarget(_SGLangTarget):
    """A running SGLang HTTP server (``python -m sglang.launch_server ... --custom-weight-loader LOADER_PATH``).

    ``api_key`` is sent as ``Authorization: Bearer <key>`` (SGLang's ``--api-key``). ``timeout``
    bounds every request (weight updates included). ``serialization``: see the module
    docstring. Environment proxies are ignored unless ``proxies`` is given.
    """

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 300.0, *,
                 serialization: str = "pickle", proxies: Optional[dict] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if serialization not in SERIALIZATIONS:
            raise SyncError("config", f"unknown serialization {serialization!r}; choose one of {SERIALIZATIONS}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.serialization = serialization
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies or {}))
        self._tp_size: Optional[int] = None
        self._no_pause = False
        self._no_version_endpoint = False

    def request(self, method: str, path: str, body: Any = None, *, ok_status: Sequence[int] = ()) -> tuple[int, Any]:
        """One JSON request; returns ``(status, decoded body)``. Raises :class:`SGLangError` on a
        network failure, 401, or any status >= 400 not in ``ok_status``."""
        url = f"{self.base_url}{path}"
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SGLangError("unreachable", f"{method} {url}: SGLang server unreachable ({reason})") from None
        try:
            decoded: Any = json.loads(raw) if raw else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            decoded = raw.decode("utf-8", "replace")
        if status == 401:
            raise SGLangError("auth", f"{method} {url}: 401 unauthorized ({_error_text(decoded)}); check api_key",
                              status=status, body=decoded)
        if status >= 400 and status not in ok_status:
            raise SGLangError("http", f"{method} {url}: HTTP {status}: {_error_text(decoded)}", status=status,
                              body=decoded)
        return status, decoded

    def _server_info(self) -> dict:
        _, info = self.request("GET", "/get_server_info")
        if not isinstance(info, dict):
            raise SGLangError("http", f"/get_server_info returned {type(info).__name__}, expected a JSON object")
        self._tp_size = int(info.get("tp_size") or 1)
        return info

    def _update(self, named_tensors, load_format, flush_cache):
        if self._tp_size is None:
            self._server_info()
        if self.serialization == "cuda_ipc":  # IPC handles of CUDA copies, alive until the server has loaded them
            named_tensors = [(n, t if t.is_cuda else t.to("cuda", non_blocking=False)) for n, t in named_tensors]
        entry = serialize_named_tensors(named_tensors, self.serialization)
        body = {"serialized_named_tensors": [entry] * int(self._tp_size or 1), "load_format": load_format,
                "flush_cache": flush_cache}
        status, resp = self.request("POST", "/update_weights_from_tensor", body, ok_status=(400,))
        if not isinstance(resp, dict):
            return False, f"HTTP {status}: {_error_text(resp)}"
        return bool(resp.get("success")) and status == 200, str(resp.get("message", ""))

    def _read_param(self, name):
        status, resp = self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": _READ_ALL},
                                    ok_status=(400,))
        return resp if status == 200 and isinstance(resp, list) else None

    def _control(self, path: str) -> None:
        if self._no_pause:
            return
        status, _ = self.request("POST", path, {}, ok_status=(404, 405))
        if status in (404, 405):
            self._no_pause = True
            logger.warning("SGLang server has no %s; updating without pausing generation", path)

    def _pause(self):
        self._control("/pause_generation")

    def _continue(self):
        self._control("/continue_generation")

    def _publish_version(self, version: int) -> None:
        if self._no_version_endpoint:
            return
        status, _ = self.request("POST", "/update_weight_version",
                                 {"new_version": str(version), "abort_all_requests": False}, ok_status=(404, 405))
        if status in (404, 405):
            self._no_version_endpoint = True
            logger.info("SGLang server has no /update_weight_version; its weight_version tag is not updated")

    def flush_cache(self) -> bool:
        """POST ``/flush_cache`` (SGLang refuses, with 400, while requests are running)."""
        status, _ = self.request("POST", "/flush_cache", ok_status=(400,))
        return status == 200

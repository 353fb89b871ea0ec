"""What the SGLang clients send and read back: request payloads, pre-send checks, and :class:`SGLangError`.

Contract: pure functions over tensors and bytes, no I/O. :func:`serialize_named_tensors` builds
one entry of an HTTP ``/update_weights_from_tensor`` request, :func:`chunk_named_tensors` cuts a
dense refit into requests of bounded size, ``_precheck`` runs the weight-free checks of
``apply.validate`` so a bad delta never reaches the engine, ``_replica_answers`` splits a
``get_weights_by_name`` answer into one answer per data-parallel replica, and ``_decode_json_param``
decodes a loader parameter read back with it (raising :class:`SGLangError`). Used by
:mod:`~megatron_logra.sync.sglang_primitives`, :mod:`~megatron_logra.sync.sglang_state`,
:mod:`~megatron_logra.sync.sglang_protocol` and :mod:`~megatron_logra.sync.sglang_client` (which
re-exports the public names).

HTTP payloads: ``serialized_named_tensors`` is a list with one base64 string per engine TP
rank (each scheduler reads entry ``tp_rank``). ``serialization="pickle"`` (default) pickles
CPU tensors by value (``torch._utils._rebuild_tensor_v2`` + ``torch.storage._load_from_bytes``,
both inside SGLang's unpickling allow-list), so it works with a server on another host at the
cost of shipping the bytes (x4/3 for base64, x TP size). ``serialization="cuda_ipc"`` sends
CUDA tensors as IPC handles (``torch.multiprocessing`` reductions, as SGLang's own
``MultiprocessingSerializer`` does): zero-copy, but only for a server on the same host that sees
the trainer's GPU (its ``CUDA_VISIBLE_DEVICES`` includes it; each scheduler opens the handle, and a CUDA
context, there), and the tensors must stay alive until the request returns (they do: calls are
synchronous). The handle names its GPU by UUID, not by index (:func:`_device_as_uuid`), as the
senders SGLang expects do after ``sglang.srt.utils.patch_torch.monkey_patch_torch_reductions``:
SGLang's receiving rebuild (``_rebuild_cuda_tensor_modified``) maps the UUID to its own index,
and older releases assert a UUID; an index would name the wrong GPU (or none) in a server whose
``CUDA_VISIBLE_DEVICES`` differs from the trainer's. ``MultiprocessingSerializer.serialize`` itself
does not patch the reductions, so it is not used; the UUIDs are written by a local pickler, and
torch's reductions in this process are left as they are. CPU tensors cannot use IPC (their shared-memory handles need the sender's
multiprocessing authkey, which an independently started server does not have).

Read-backs: SGLang's ``TokenizerManager.get_weights_by_name`` asks every data-parallel replica
and answers the bare parameter values at ``dp_size == 1`` and the list of every replica's answer
(``None`` for a replica that could not read it) otherwise; :func:`_replica_answers` turns both
shapes into one list per replica.

Imports only torch and the standard library besides the sync package (never SGLang).
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch

from megatron_logra.sync.apply import check_version
from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.sglang_wire import bytes_from_values

__all__ = ["SGLangError", "serialize_named_tensors", "chunk_named_tensors", "SERIALIZATIONS", "DEFAULT_CHUNK_BYTES"]

SERIALIZATIONS = ("pickle", "cuda_ipc")
DEFAULT_CHUNK_BYTES = 512 << 20


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
    via ``torch.multiprocessing``'s reductions (same host only), each naming its GPU by UUID as
    SGLang's receiving side expects (module docstring).
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
        buf = io.BytesIO()
        _uuid_pickler(buf).dump(obj)  # pragma: no cover - needs CUDA
        return base64.b64encode(buf.getvalue()).decode("ascii")  # pragma: no cover
    raise SyncError("config", f"unknown serialization {serialization!r}; choose one of {SERIALIZATIONS}")


CUDA_DEVICE_ARG = 6
"""Index of the device in the arguments of torch's ``rebuild_cuda_tensor`` (``reduce_tensor`` of a CUDA
tensor); SGLang's ``patch_torch`` rewrites the same slot."""


def cuda_device_uuid(device: int) -> str:
    """The UUID SGLang's ``patch_torch`` names CUDA device ``device`` by (``str`` of its properties' ``uuid``)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _device_as_uuid(reduction: Any, uuid_of: Any = cuda_device_uuid) -> Any:
    """``reduction`` (a ``(rebuild, args)`` pair of ``torch.multiprocessing.reductions.reduce_tensor``) with
    the CUDA device index at :data:`CUDA_DEVICE_ARG` replaced by ``uuid_of(index)``; anything else (a CPU
    or meta tensor's shorter arguments, a device already named by UUID) unchanged."""
    fn, args = reduction
    if getattr(fn, "__name__", "") != "rebuild_cuda_tensor" or len(args) <= CUDA_DEVICE_ARG:
        return reduction
    device = args[CUDA_DEVICE_ARG]
    if isinstance(device, bool) or not isinstance(device, int):
        return reduction
    return fn, (*args[:CUDA_DEVICE_ARG], uuid_of(device), *args[CUDA_DEVICE_ARG + 1:])


def _uuid_pickler(buf: io.BytesIO) -> Any:
    """A ``ForkingPickler`` on ``buf`` that reduces CUDA tensors with torch's ``reduce_tensor``, their
    device named by UUID (:func:`_device_as_uuid`)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    class _Pickler(ForkingPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                return _device_as_uuid(reductions.reduce_tensor(obj))
            return NotImplemented

    return _Pickler(buf)


def chunk_named_tensors(state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                        max_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups of ``(name, tensor)`` of at most ``max_bytes`` each (a larger tensor travels alone).

    A mapping goes in name order; a stream of pairs in its own order, pulled lazily, so at
    most one chunk (plus the next tensor) is held at a time.
    """
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    pairs = ((name, state[name]) for name in sorted(state)) if isinstance(state, Mapping) else state
    for name, t in pairs:
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
    for name, v in delta.dense.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise SyncError("nonfinite", f"dense {name} has non-finite entries")


def _replica_answers(values: Any, dp_size: Optional[int], what: str) -> Optional[list[Optional[list]]]:
    """One ``get_weights_by_name`` answer per data-parallel replica (None for a replica without one).

    ``values`` is SGLang's answer for a 1-D parameter: its values (a list of numbers) at
    ``dp_size == 1``; a list with one such list (or ``None``) per replica otherwise. Returns None
    when no replica answered. ``dp_size`` is the server's (None: not known); a server with
    ``dp_size > 1`` must answer once per replica, else :class:`SGLangError` ``engine``.
    """
    if values is None:
        return None
    if not isinstance(values, list):
        raise SGLangError("engine", f"{what}: expected a list from get_weights_by_name, got {type(values).__name__}")
    per_replica = bool(values) and all(v is None or isinstance(v, list) for v in values)
    answers: list[Optional[list]] = list(values) if per_replica else [values]
    if dp_size is not None and dp_size > 1 and len(answers) != dp_size:
        raise SGLangError("engine", f"{what}: the SGLang engine has dp_size={dp_size} data-parallel replicas but "
                                    f"get_weights_by_name answered for {len(answers) if per_replica else 'one'}")
    return None if all(a is None for a in answers) else answers


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

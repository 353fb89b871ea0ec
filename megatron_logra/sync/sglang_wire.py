"""The request and outcome encoding shared by the SGLang client and the engine-side loader.

Contract: how :mod:`~megatron_logra.sync.sglang_client` (trainer side) and
:mod:`~megatron_logra.sync.sglang_loader` (inside SGLang) talk through
``update_weights_from_tensor`` and ``get_weights_by_name``: the tensor and parameter names,
:data:`LOADER_PATH`, building and splitting requests, and the JSON-in-a-parameter encoding of
the loader's outcome. No model logic here.

Requests (``named_tensors``) carry up to two uint8 tensors: :data:`TENSOR_NAME` (an encoded
delta, :func:`delta_as_named_tensors`) and :data:`COMMAND_NAME` (UTF-8 JSON,
:func:`command_as_named_tensors`): ``{"op": "apply"|"status"|"set_version"|"fingerprint",
"nonce": ..., "version": ..., "fingerprint": bool, "rows_per_tensor": int}``. The loader's
outcome and fingerprint come back as JSON bytes stored as fp32 values in the root parameters
:data:`STATE_PARAM` and :data:`FINGERPRINT_PARAM` (:func:`bytes_from_values`, :func:`read_state`).
Engine side: imports only torch, the standard library and the sync package.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from megatron_logra.sync.codec import SketchDelta, encode
from megatron_logra.sync.errors import SyncError

__all__ = ["TENSOR_NAME", "COMMAND_NAME", "STATE_PARAM", "FINGERPRINT_PARAM", "LOADER_PATH",
           "delta_as_named_tensors", "command_as_named_tensors", "read_state", "bytes_from_values"]

TENSOR_NAME = "logra.sketch_delta"
COMMAND_NAME = "logra.command"
STATE_PARAM = "logra_sync_state"
"""Root parameter holding the JSON outcome of the last :func:`~megatron_logra.sync.sglang_loader.sync_loader`
call (fp32 byte values)."""
FINGERPRINT_PARAM = "logra_sync_fingerprint"
"""Root parameter holding the JSON engine fingerprint ``{"version": v, "fingerprint": {name: hex}}``."""
LOADER_PATH = "megatron_logra.sync.sglang_loader.sync_loader"
"""What to pass to ``--custom-weight-loader`` and as ``load_format``."""


def delta_as_named_tensors(delta: Union[SketchDelta, bytes]) -> list[tuple[str, torch.Tensor]]:
    """``[(TENSOR_NAME, uint8 tensor of the encoded delta)]`` for ``update_weights_from_tensor``."""
    data = encode(delta) if isinstance(delta, SketchDelta) else bytes(delta)
    return [(TENSOR_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def _payload(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    names = [n for n, _ in named_tensors]
    if names != [TENSOR_NAME]:
        raise SyncError("keys", f"load_sketch_delta expects exactly one tensor named {TENSOR_NAME!r}, got {names}")
    tensor = named_tensors[0][1]
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise SyncError("dtype", f"{TENSOR_NAME} must be a 1-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.detach().cpu().contiguous().numpy().tobytes()


def command_as_named_tensors(command: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``[(COMMAND_NAME, uint8 tensor of the command as UTF-8 JSON)]``."""
    data = json.dumps(command, sort_keys=True, separators=(",", ":")).encode()
    return [(COMMAND_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def _tensor_bytes(name: str, tensor: torch.Tensor) -> bytes:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise SyncError("dtype", f"{name} must be a 1-D uint8 tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    return tensor.detach().cpu().contiguous().numpy().tobytes()


def _split_request(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[Optional[list], dict]:
    """``(delta named tensors or None, command dict)``; raises ``SyncError("keys")`` on anything else."""
    names = [n for n, _ in named_tensors]
    unknown = sorted(set(names) - {TENSOR_NAME, COMMAND_NAME})
    if unknown or len(set(names)) != len(names) or not names:
        raise SyncError("keys", f"sync_loader expects {TENSOR_NAME!r} and/or {COMMAND_NAME!r} once each, got {names}")
    command: dict = {}
    delta = None
    for name, tensor in named_tensors:
        if name == COMMAND_NAME:
            try:
                command = json.loads(_tensor_bytes(name, tensor))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise SyncError("keys", f"{COMMAND_NAME} is not UTF-8 JSON ({exc})") from None
            if not isinstance(command, dict):
                raise SyncError("keys", f"{COMMAND_NAME} must be a JSON object")
        else:
            delta = [(name, tensor)]
    return delta, command


def _write_json_param(model: nn.Module, name: str, obj: dict) -> None:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.float32)
    setattr(model, name, nn.Parameter(values, requires_grad=False))


def bytes_from_values(values: Sequence[float]) -> bytes:
    """Inverse of the parameter encoding: fp32 byte values (as ``get_weights_by_name`` returns them) -> bytes."""
    out = bytearray()
    for x in values:
        b = int(x)
        if b != x or not 0 <= b <= 255:
            raise SyncError("keys", f"sync state holds {x!r}, not a byte value")
        out.append(b)
    return bytes(out)


def read_state(model: nn.Module, name: str = STATE_PARAM) -> Optional[dict]:
    """The JSON object stored in parameter ``name`` of ``model`` (None before the first call)."""
    param = dict(model.named_parameters()).get(name)
    return None if param is None else json.loads(bytes_from_values(param.detach().cpu().tolist()))

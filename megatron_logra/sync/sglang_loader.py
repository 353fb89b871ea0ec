"""SGLang custom weight loaders that apply encoded sketch deltas to a live model.

SGLang's ``update_weights_from_tensor(named_tensors, load_format=...)`` calls, on every TP
rank, ``custom_loader(model, named_tensors)`` when ``load_format`` is the dotted path of a
function listed in the server's ``--custom-weight-loader`` (``ModelRunner.update_weights_from_tensor``,
resolved with ``dynamic_import``). Register :data:`LOADER_PATH`::

    --custom-weight-loader megatron_logra.sync.sglang_loader.sync_loader

**Use** :func:`sync_loader` **with SGLang, not** :func:`load_sketch_delta`. SGLang calls the
custom loader without a ``try`` (model runner, TP worker and scheduler all let exceptions
through), so a loader that raises takes the scheduler process -- and the server -- down.
:func:`sync_loader` never raises: it records the outcome (ok / rejected and why, the weight
version, a per-call nonce) as JSON bytes in a small CPU parameter :data:`STATE_PARAM` on the
model, which a client reads back with SGLang's ``get_weights_by_name``
(:mod:`megatron_logra.sync.sglang_client`). :func:`load_sketch_delta` is the raising core it wraps
(used directly by tests and in-process engines).

Requests (``named_tensors``) carry up to two uint8 tensors: :data:`TENSOR_NAME` (an encoded
delta, :func:`delta_as_named_tensors`) and :data:`COMMAND_NAME` (UTF-8 JSON,
:func:`command_as_named_tensors`): ``{"op": "apply"|"status"|"set_version"|"fingerprint",
"nonce": ..., "version": ..., "fingerprint": bool, "rows_per_tensor": int}``. Every rank
receives the whole (TP=1, Megatron-order) delta and takes its own share: its rows of U for
the column-parallel ``qkv_proj``/``gate_up_proj``, its columns of A for the row-parallel
``o_proj``/``down_proj`` (see :mod:`megatron_logra.sync.layout`). With TP > 1 the ranks agree
(all-reduce MIN over SGLang's TP CPU group) after validation and after the commit, so either
every rank applies or none does; a failure after some rank committed marks the version
unknown (-1) until a full refit sets it (``set_version``).

The engine's TP rank/size come from the ``tp_rank``/``tp_size`` attributes of SGLang's
parallel linear modules (or SGLang's parallel state, or 0/1); the weight version lives on the
model as ``model._logra_weight_version`` (0 at load). The delta is validated in full before
any parameter changes. ``fingerprint`` (TP=1 engines only) hashes the weights in Hugging Face
layout (fused ``qkv_proj``/``gate_up_proj`` split back, vocab padding rows dropped) with
:func:`megatron_logra.sync.fingerprint.fingerprint`, so it compares with the trainer's
fingerprint of its HF state; it is stored in :data:`FINGERPRINT_PARAM`. Imports only torch,
the standard library and the sync package (SGLang is optional).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from megatron_logra.sync.apply import apply_delta_, validate
from megatron_logra.sync.codec import AttentionDims, SketchDelta, decode, encode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.fingerprint import fingerprint as _fingerprint

logger = logging.getLogger(__name__)

__all__ = ["TENSOR_NAME", "COMMAND_NAME", "VERSION_ATTR", "STATE_PARAM", "FINGERPRINT_PARAM", "LOADER_PATH",
           "delta_as_named_tensors", "command_as_named_tensors", "engine_tp", "engine_version", "engine_hf_view",
           "load_sketch_delta", "sync_loader", "read_state", "bytes_from_values"]

TENSOR_NAME = "logra.sketch_delta"
COMMAND_NAME = "logra.command"
VERSION_ATTR = "_logra_weight_version"
STATE_PARAM = "logra_sync_state"
"""Root parameter holding the JSON outcome of the last :func:`sync_loader` call (fp32 byte values)."""
FINGERPRINT_PARAM = "logra_sync_fingerprint"
"""Root parameter holding the JSON engine fingerprint ``{"version": v, "fingerprint": {name: hex}}``."""
LOADER_PATH = "megatron_logra.sync.sglang_loader.sync_loader"
"""What to pass to ``--custom-weight-loader`` and as ``load_format``."""
_ATTENTION_ATTR = "_logra_attention"
_SEQ_ATTR = "_logra_seq"
_OWN_PARAMS = (STATE_PARAM, FINGERPRINT_PARAM)


def delta_as_named_tensors(delta: Union[SketchDelta, bytes]) -> list[tuple[str, torch.Tensor]]:
    """``[(TENSOR_NAME, uint8 tensor of the encoded delta)]`` for ``update_weights_from_tensor``."""
    data = encode(delta) if isinstance(delta, SketchDelta) else bytes(delta)
    return [(TENSOR_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def engine_tp(model: nn.Module) -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of this engine rank (module attributes, SGLang's state, or ``(1, 0)``)."""
    for module in model.modules():
        size, rank = getattr(module, "tp_size", None), getattr(module, "tp_rank", None)
        if isinstance(size, int) and isinstance(rank, int) and size >= 1:
            return size, rank
    try:  # pragma: no cover - only inside an SGLang worker
        from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size()), int(get_tensor_model_parallel_rank())
    except Exception:  # sglang missing or its parallel state not initialised
        return 1, 0


def engine_version(model: nn.Module) -> int:
    """Weight version recorded on ``model`` by this loader (0 before the first delta)."""
    return int(getattr(model, VERSION_ATTR, 0))


def _payload(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    names = [n for n, _ in named_tensors]
    if names != [TENSOR_NAME]:
        raise SyncError("keys", f"load_sketch_delta expects exactly one tensor named {TENSOR_NAME!r}, got {names}")
    tensor = named_tensors[0][1]
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise SyncError("dtype", f"{TENSOR_NAME} must be a 1-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.detach().cpu().contiguous().numpy().tobytes()


@torch.no_grad()
def load_sketch_delta(model: nn.Module, named_tensors: list[tuple[str, torch.Tensor]],
                      *, tp_size: Optional[int] = None, tp_rank: Optional[int] = None) -> None:
    """SGLang custom weight loader: decode, validate and apply one sketch delta to ``model``.

    ``model`` holds SGLang's fused parameter names (``model.layers.{i}.self_attn.qkv_proj.weight``,
    ``...o_proj.weight``, ``...mlp.gate_up_proj.weight``, ``...mlp.down_proj.weight``, norms,
    embeddings) sharded for one TP rank. Raises :class:`SyncError` and leaves the model
    untouched when anything does not fit (version, names, shapes, dtypes, non-finite values).
    """
    delta = decode(_payload(named_tensors))
    size, rank = engine_tp(model) if tp_size is None or tp_rank is None else (tp_size, tp_rank)
    weights = {n: p.data for n, p in model.named_parameters()}
    new_version = apply_delta_(weights, delta, engine_version(model), layout="sglang", tp_size=size, tp_rank=rank)
    setattr(model, VERSION_ATTR, new_version)
    logger.info("sglang rank %d/%d: sketch delta applied, weight version %d", rank, size, new_version)


# --------------------------------------------------------------------------- the SGLang entry point


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


def _tp_cpu_group():  # pragma: no cover - only inside an SGLang worker with TP > 1
    try:
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
        return group.cpu_group if int(group.world_size) > 1 else None
    except Exception:  # sglang missing or its parallel state not initialised
        return None


def _tp_all(ok: bool) -> bool:
    """True iff ``ok`` on every rank of the engine's TP group (all-reduce MIN); ``ok`` without a group."""
    group = _tp_cpu_group()
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)  # pragma: no cover - needs a TP group
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)  # pragma: no cover
    return bool(flag.item())  # pragma: no cover


def _own_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters() if n not in _OWN_PARAMS}


def _attention_dims(model: nn.Module) -> Optional[AttentionDims]:
    dims = getattr(model, _ATTENTION_ATTR, None)
    if dims is not None:
        return dims
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionDims(heads, int(kv), int(d))


@torch.no_grad()
def engine_hf_view(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a TP=1 SGLang model under Hugging Face names (views, no copies).

    ``qkv_proj`` is split into ``q_proj``/``k_proj``/``v_proj`` (attention dims from the last
    delta, else ``model.config``), ``gate_up_proj`` into ``gate_proj``/``up_proj``, and the
    vocab-parallel ``embed_tokens``/``lm_head`` lose SGLang's padding rows (``org_vocab_size``).
    A tied ``lm_head`` is a shared parameter and appears once, as ``embed_tokens`` (as in the
    trainer's HF state). Raises ``SyncError("layout")`` when a fused weight does not fit.
    """
    size, _ = engine_tp(model)
    if size != 1:
        raise SyncError("layout", f"the HF view needs an unsharded engine, this one has TP={size}")
    dims = _attention_dims(model)
    out: dict[str, torch.Tensor] = {}
    for name, w in _own_weights(model).items():
        head, _, leaf = name.rpartition(".")
        if head.endswith("qkv_proj"):
            if dims is None:
                raise SyncError("layout", f"{name}: attention dims unknown (no delta yet and no model.config)")
            q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
            if w.shape[0] != q + 2 * kv:
                raise SyncError("layout", f"{name}: {w.shape[0]} rows, attention dims imply {q + 2 * kv}")
            pre = head[: -len("qkv_proj")]
            out[f"{pre}q_proj.{leaf}"], out[f"{pre}k_proj.{leaf}"], out[f"{pre}v_proj.{leaf}"] = w.split([q, kv, kv])
        elif head.endswith("gate_up_proj"):
            pre = head[: -len("gate_up_proj")]
            out[f"{pre}gate_proj.{leaf}"], out[f"{pre}up_proj.{leaf}"] = w.chunk(2, dim=0)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = getattr(model.get_submodule(head), "org_vocab_size", None)
            out[name] = w[:rows] if isinstance(rows, int) and 0 < rows <= w.shape[0] else w
        else:
            out[name] = w
    return out


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


@torch.no_grad()
def _apply(model: nn.Module, delta_tensors: list, size: int, rank: int) -> tuple[int, Optional[SyncError]]:
    """Validate on every rank, agree, commit, agree. Returns ``(version, error)``; never raises."""
    version = engine_version(model)
    error: Optional[SyncError] = None
    delta = None
    try:
        delta = decode(_payload(delta_tensors))
        validate(delta, _own_weights(model), version, layout="sglang", tp_size=size, tp_rank=rank)
    except SyncError as exc:
        error = exc
    except Exception as exc:  # anything else is still a rejection, never a crash of the engine
        error = SyncError("apply", f"validating the delta failed: {exc!r}")
    if not _tp_all(error is None):
        return version, error or SyncError("rejected", "another TP rank of the engine rejected the delta")
    try:
        new_version = apply_delta_(_own_weights(model), delta, version, layout="sglang", tp_size=size, tp_rank=rank)
    except SyncError as exc:
        error = exc
    except Exception as exc:  # pragma: no cover - apply_delta_ maps its own failures to SyncError
        error = SyncError("apply", f"applying the delta failed: {exc!r}")
    if not _tp_all(error is None):  # some rank may have committed: the engine as a whole is inconsistent
        reason = error or "another TP rank failed to apply the delta after this one committed"
        setattr(model, VERSION_ATTR, -1)
        return -1, SyncError("apply", f"{reason} -- engine weights may differ across TP ranks; "
                                      "a full refit must set the version")
    setattr(model, VERSION_ATTR, new_version)
    setattr(model, _ATTENTION_ATTR, delta.attention or getattr(model, _ATTENTION_ATTR, None))
    return new_version, None


def sync_loader(model: nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """The custom weight loader to register with SGLang (:data:`LOADER_PATH`); never raises.

    Applies a delta (:data:`TENSOR_NAME`) and/or runs a command (:data:`COMMAND_NAME`), then
    writes the outcome to :data:`STATE_PARAM`: ``{"format", "seq", "nonce", "op", "ok",
    "error", "error_kind", "version", "tp_size", "tp_rank", "fingerprint_version",
    "fingerprint_error"}``. Rejections leave the weights and the version untouched.
    """
    seq = int(getattr(model, _SEQ_ATTR, 0)) + 1
    setattr(model, _SEQ_ATTR, seq)
    state: dict[str, Any] = {"format": "logra-sync-state/1", "seq": seq, "nonce": None, "op": None, "ok": False,
                             "error": None, "error_kind": None, "version": engine_version(model),
                             "fingerprint_version": None, "fingerprint_error": None}
    try:
        size, rank = engine_tp(model)
        state.update(tp_size=size, tp_rank=rank)
        error: Optional[SyncError] = None
        try:
            delta_tensors, command = _split_request(named_tensors)
        except SyncError as exc:
            delta_tensors, command, error = None, {}, exc
        state["nonce"] = command.get("nonce")
        op = "apply" if delta_tensors is not None else str(command.get("op", "status"))
        state["op"] = op
        if error is None:
            if op == "apply":
                state["version"], error = _apply(model, delta_tensors, size, rank)
            elif op == "set_version":
                version = command.get("version")
                if not isinstance(version, int) or version < 0:
                    error = SyncError("keys", f"set_version needs a non-negative integer version, got {version!r}")
                else:
                    setattr(model, VERSION_ATTR, version)
                    state["version"] = version
            elif op not in ("status", "fingerprint"):
                error = SyncError("keys", f"unknown sync_loader op {op!r}")
        if error is None and (op == "fingerprint" or command.get("fingerprint")):
            try:
                fp = _fingerprint(engine_hf_view(model), int(command.get("rows_per_tensor", 4)))
                _write_json_param(model, FINGERPRINT_PARAM, {"version": engine_version(model), "fingerprint": fp})
                state["fingerprint_version"] = engine_version(model)
            except Exception as exc:  # a fingerprint failure never fails the sync itself
                state["fingerprint_error"] = str(exc)
        state["ok"] = error is None
        if error is not None:
            state["error"], state["error_kind"] = str(error), error.kind
            logger.error("sglang rank %d/%d: sync_loader %s rejected: %s", rank, size, op, error)
        else:
            logger.info("sglang rank %d/%d: sync_loader %s ok, weight version %d", rank, size, op, state["version"])
    except Exception as exc:  # pragma: no cover - last line of defence for the engine process
        state.update(ok=False, error=f"sync_loader failed: {exc!r}", error_kind="apply")
        logger.exception("sync_loader failed")
    try:
        _write_json_param(model, STATE_PARAM, state)
    except Exception:  # pragma: no cover
        logger.exception("sync_loader could not record its state")

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
model, which a client (:mod:`megatron_logra.sync.sglang_client`) reads back with SGLang's
``get_weights_by_name`` (supplied on the model instance for classes that lack it, such as Qwen2/Qwen3, by
:mod:`megatron_logra.sync.sglang_readback`). :func:`load_sketch_delta` raises instead of recording (for
in-process callers); both apply a delta through the same function, so they change the same weights (the
model's own, never the loader's record parameters), the version and the recorded attention dims alike, and
fail with the same error.

Requests (see :mod:`~megatron_logra.sync.sglang_wire`) carry an encoded delta and/or a JSON
command (``apply``, ``status``, ``set_version``, ``fingerprint``). Every rank
receives the whole (TP=1, Megatron-order) delta and takes its own share: its rows of U for
the column-parallel ``qkv_proj``/``gate_up_proj``, its columns of A for the row-parallel
``o_proj``/``down_proj`` (see :mod:`megatron_logra.sync.layout`). With TP > 1 the ranks agree
(all-reduce MIN over SGLang's TP CPU group) after staging (validation and every allocation of the
commit) and after the commit, so either every rank applies or none does; a failure after some rank committed marks the version
unknown (-1) until a full refit sets it (``set_version``). A full refit itself first sets -1, so
a refit that stops part-way can never pass for the version before it.

The delta is validated in full before any parameter changes. With speculative decoding SGLang
runs the loader on the draft model first, then on the target model: the draft (a layer or two)
lacks most of the delta's targets and refuses it untouched, and the outcome the client reads back
(``get_weights_by_name``) is the target model's. The engine's TP position, weight
version and Hugging Face view come from :mod:`~megatron_logra.sync.sglang_weights`.
``fingerprint`` works at every TP size: the ranks exchange their shares of the sampled rows of
each HF tensor over SGLang's TP CPU group (:mod:`~megatron_logra.sync.sglang_fingerprint`), so
every rank stores the same record in :data:`FINGERPRINT_PARAM`, equal to the TP=1 fingerprint
of the full HF tensors. The rows are sampled with the engine's weight version as the salt
(``fingerprint(hf, salt=version)``; the digests end in ``@<version>``), so successive drift checks
cover different rows and the trainer, reading the salt back with
:func:`~megatron_logra.sync.fingerprint.fingerprint_salt`, samples the same ones. The names of
the helper modules stay importable from here. Imports only torch, the standard library and the
sync package (SGLang is optional).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from megatron_logra.sync.apply import ProjectionCache, StagedDelta, stage_delta
from megatron_logra.sync.codec import decode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.sglang_fingerprint import engine_fingerprint
from megatron_logra.sync.sglang_readback import serve_records
from megatron_logra.sync.sglang_weights import (
    VERSION_ATTR,
    _ATTENTION_ATTR,
    _own_weights,
    engine_hf_view,
    engine_dtype,
    engine_tp,
    engine_version,
    engine_vocab_size,
)
from megatron_logra.sync.sglang_wire import (
    COMMAND_NAME,
    FINGERPRINT_PARAM,
    LOADER_PATH,
    STATE_PARAM,
    TENSOR_NAME,
    _payload,
    _split_request,
    _write_json_param,
    bytes_from_values,
    command_as_named_tensors,
    delta_as_named_tensors,
    read_state,
)

logger = logging.getLogger(__name__)

__all__ = ["TENSOR_NAME", "COMMAND_NAME", "VERSION_ATTR", "STATE_PARAM", "FINGERPRINT_PARAM", "LOADER_PATH",
           "delta_as_named_tensors", "command_as_named_tensors", "engine_tp", "engine_version", "engine_hf_view",
           "load_sketch_delta", "sync_loader", "read_state", "bytes_from_values"]

_SEQ_ATTR = "_logra_seq"
_CACHE_ATTR = "_logra_projections"


def _projections(model: nn.Module) -> ProjectionCache:
    """The model's :class:`ProjectionCache` (``sign(A)`` kept across syncs), created on first use."""
    cache = getattr(model, _CACHE_ATTR, None)
    if not isinstance(cache, ProjectionCache):
        cache = ProjectionCache()
        object.__setattr__(model, _CACHE_ATTR, cache)
    return cache


def load_sketch_delta(model: nn.Module, named_tensors: list[tuple[str, torch.Tensor]],
                      *, tp_size: Optional[int] = None, tp_rank: Optional[int] = None) -> None:
    """Decode, validate and apply one sketch delta to ``model``; raises where :func:`sync_loader` records.

    ``model`` holds SGLang's fused parameter names (``model.layers.{i}.self_attn.qkv_proj.weight``,
    ``...o_proj.weight``, ``...mlp.gate_up_proj.weight``, ``...mlp.down_proj.weight``, norms,
    embeddings) sharded for one TP rank (``tp_size``/``tp_rank``, default: read from the model).
    ``named_tensors`` is exactly ``[(TENSOR_NAME, encoded delta)]``. The delta goes through the same
    apply as :func:`sync_loader`'s (:func:`_apply`): it may name only the model's weights, not the
    loader's record parameters; on success the version and the delta's attention dims are recorded.
    Raises :class:`SyncError` (the error :func:`sync_loader` would record): when anything does not fit
    (version, names, shapes, dtypes, non-finite values, an allocation failing while the delta is
    staged) the model is untouched, weights and version; a commit that fails after its first write
    (a kernel error) leaves the weight version -1 (unknown: every delta, the same one included, is
    refused until a full refit sets the version, ``set_version``).
    """
    size, rank = engine_tp(model) if tp_size is None or tp_rank is None else (tp_size, tp_rank)
    _, error = _apply(model, named_tensors, size, rank)
    if error is not None:
        raise error


# --------------------------------------------------------------------------- the SGLang entry point


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


@torch.no_grad()
def _apply(model: nn.Module, delta_tensors: list, size: int, rank: int) -> tuple[int, Optional[SyncError]]:
    """Apply one delta (``delta_tensors``: ``[(TENSOR_NAME, encoded delta)]``) to the model's own weights
    (not the loader's record parameters): stage on every rank, agree, commit, agree. Returns ``(version,
    error)`` and raises nothing but a ``BaseException`` that is no ``Exception`` (after marking the version
    -1 when it stopped a commit); the one path of :func:`load_sketch_delta` and :func:`sync_loader`.

    Staging validates and allocates everything the commit needs (:func:`stage_delta`), so the first
    agreement covers a rank that ran out of memory preparing as well as one that rejected the delta:
    either way no rank writes, and the weights and the version stay. A commit that fails on some rank
    sets the version -1 (unknown); a successful one records the new version and the delta's attention dims.
    """
    version = engine_version(model)
    error: Optional[SyncError] = None
    staged: Optional[StagedDelta] = None
    try:
        staged = stage_delta(_own_weights(model), decode(_payload(delta_tensors)), version, layout="sglang",
                             tp_size=size, tp_rank=rank, cache=_projections(model))
    except SyncError as exc:
        error = exc
    except Exception as exc:  # anything else is still a rejection, never a crash of the engine
        error = SyncError("apply", f"validating the delta failed: {exc!r}")
    if not _tp_all(error is None):
        return version, error or SyncError("rejected", "another TP rank of the engine rejected the delta")
    try:
        new_version = staged.commit_()
    except SyncError as exc:
        error = exc
    except Exception as exc:  # pragma: no cover - commit_ maps its own failures to SyncError
        error = SyncError("apply", f"applying the delta failed: {exc!r}")
    except BaseException:  # interrupted part-way: the delta must not be applied again on top of it
        setattr(model, VERSION_ATTR, -1)
        raise
    if not _tp_all(error is None):  # some rank may have committed: the engine as a whole is inconsistent
        reason = (error.message if error is not None
                  else "another TP rank failed to apply the delta after this one committed")
        setattr(model, VERSION_ATTR, -1)
        return -1, SyncError("apply", f"{reason} -- engine weights may differ across TP ranks; "
                                      "a full refit must set the version")
    setattr(model, VERSION_ATTR, new_version)
    setattr(model, _ATTENTION_ATTR, staged.delta.attention or getattr(model, _ATTENTION_ATTR, None))
    logger.info("sglang rank %d/%d: sketch delta applied, weight version %d", rank, size, new_version)
    return new_version, None


def sync_loader(model: nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """The custom weight loader to register with SGLang (:data:`LOADER_PATH`); never raises.

    Applies a delta (:data:`TENSOR_NAME`) and/or runs a command (:data:`COMMAND_NAME`), then
    writes the outcome to :data:`STATE_PARAM`: ``{"format", "seq", "nonce", "op", "ok",
    "error", "error_kind", "version", "tp_size", "tp_rank", "vocab_size", "dtype", "fingerprint_version",
    "fingerprint_error"}`` (``vocab_size``: the served model's vocabulary,
    :func:`~megatron_logra.sync.sglang_weights.engine_vocab_size`, which clients trim the trainer's
    padded vocabulary rows to; ``dtype``: its weights' dtype, :func:`~megatron_logra.sync.sglang_weights.engine_dtype`). Rejections leave the weights and the version untouched. A fingerprint
    (``op="fingerprint"`` or ``"fingerprint": true``) runs on every rank or on none (``error``
    is the same on every rank: each gets the same request and ``apply`` agrees over the group),
    since at TP > 1 it is collective; it samples the rows of the engine's weight version (the salt) and
    writes ``{"version", "fingerprint"}`` to :data:`FINGERPRINT_PARAM`; its failure is recorded in
    ``fingerprint_error``, never failing the sync.
    """
    try:
        serve_records(model)
    except Exception:  # pragma: no cover - never fail an update over the read-back path
        logger.exception("sync_loader could not make its records readable")
    seq = int(getattr(model, _SEQ_ATTR, 0)) + 1
    setattr(model, _SEQ_ATTR, seq)
    state: dict[str, Any] = {"format": "logra-sync-state/1", "seq": seq, "nonce": None, "op": None, "ok": False,
                             "error": None, "error_kind": None, "version": engine_version(model),
                             "fingerprint_version": None, "fingerprint_error": None}
    try:
        size, rank = engine_tp(model)
        state.update(tp_size=size, tp_rank=rank, vocab_size=engine_vocab_size(model), dtype=engine_dtype(model))
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
                if isinstance(version, bool) or not isinstance(version, int) or version < -1:
                    error = SyncError("keys", "set_version needs a non-negative integer version (or -1: unknown), "
                                              f"got {version!r}")
                else:
                    setattr(model, VERSION_ATTR, version)
                    state["version"] = version
            elif op not in ("status", "fingerprint"):
                error = SyncError("keys", f"unknown sync_loader op {op!r}")
        if error is None and (op == "fingerprint" or command.get("fingerprint")):
            try:
                rows_per_tensor = int(command.get("rows_per_tensor", 4))  # the same on every rank
                fp_version = engine_version(model)  # the same on every rank: the salt of the row sample
                # collective at TP > 1
                fp = engine_fingerprint(model, _tp_cpu_group(), rows_per_tensor, salt=fp_version)
                _write_json_param(model, FINGERPRINT_PARAM, {"version": fp_version, "fingerprint": fp})
                state["fingerprint_version"] = fp_version
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

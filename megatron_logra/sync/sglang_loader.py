"""SGLang custom weight loader that applies an encoded sketch delta to a live model.

SGLang's ``update_weights_from_tensor(named_tensors, load_format=...)`` calls, on every TP
rank, ``custom_loader(model, named_tensors)`` when ``load_format`` is the dotted path of a
function listed in the server's ``--custom-weight-loader``. Register::

    --custom-weight-loader megatron_logra.sync.sglang_loader.load_sketch_delta

and send ``delta_as_named_tensors(encoded)`` (one uint8 tensor named :data:`TENSOR_NAME`)
with ``load_format="megatron_logra.sync.sglang_loader.load_sketch_delta"``. Every rank
receives the whole (TP=1, Megatron-order) delta and takes its own share: its rows of U for
the column-parallel ``qkv_proj``/``gate_up_proj``, its columns of A for the row-parallel
``o_proj``/``down_proj`` (see :mod:`megatron_logra.sync.layout`).

The engine's TP rank/size come from the ``tp_rank``/``tp_size`` attributes of SGLang's
parallel linear modules (or SGLang's parallel state, or 0/1); the weight version lives on the
model as ``model._logra_weight_version`` (0 at load). The delta is validated in full before
any parameter changes. Imports only torch and the sync package (SGLang is optional).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
from torch import nn

from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.codec import SketchDelta, decode, encode
from megatron_logra.sync.errors import SyncError

logger = logging.getLogger(__name__)

__all__ = ["TENSOR_NAME", "VERSION_ATTR", "delta_as_named_tensors", "engine_tp", "engine_version",
           "load_sketch_delta"]

TENSOR_NAME = "logra.sketch_delta"
VERSION_ATTR = "_logra_weight_version"


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

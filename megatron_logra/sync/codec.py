"""Wire format of a sketch delta: one safetensors blob with a JSON header and a sha256.

A :class:`SketchDelta` moves an engine from ``base_version`` to ``new_version``. For each
target layer it carries ``U = quantize_factor(α·D)`` (bf16 ``[n_out, r]``, the *full*, TP-gathered
rows in Megatron order: ``linear_qkv`` rows interleaved per query group, ``linear_fc1`` =
``[gate; up]``) plus what regenerates ``A`` ``[r, n_in]``: ``(seed, canonical name,
update index, rank, distribution)``. The engine applies ``W ← decay·W − U·A``
(:mod:`megatron_logra.sync.apply`). Trained non-target parameters travel dense under
Hugging Face names.

Bytes (``encode``): a safetensors file whose tensors are ``U/<canonical name>`` (bf16) and
``dense/<HF name>``, and whose one metadata entry ``logra.delta`` is the JSON
``{"header": {...}, "sha256": hex}``; the sha256 is over ``b"logra-sketch-delta|"``, the
header as canonical JSON (sorted keys, no spaces) and then, for every tensor in sorted key
order, ``key, dtype, shape`` and its raw little-endian bytes. So it covers every byte of the
message's *content* (header, tensor names, dtypes, shapes, tensor data), not the container's
layout: the order of the safetensors tensor-info entries, where each tensor's bytes sit in the
data section, and extra fields in a tensor-info entry are not hashed, and a message that differs
from ``encode``'s output only there decodes to the same delta. Encoding is deterministic (equal
deltas give equal bytes). No pickle.

``decode`` re-checks everything and raises :class:`SyncError` naming the problem: truncated
bytes (``truncated``: fewer bytes than the safetensors header promises), bytes that do not
parse (``malformed``), unknown format version, checksum mismatch, missing or extra keys, wrong
dtype or shape. Imports only torch, safetensors and the standard library.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass, field
from typing import Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.schema import DENSE_DTYPES, FORMAT_VERSION, LAYOUTS, MAGIC, check_header, expected_layout

_META_KEY = "logra.delta"

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION", "LAYOUTS", "AttentionDims", "TargetFactor", "SketchDelta",
    "encode", "decode", "expected_layout",
]


@dataclass(frozen=True)
class AttentionDims:
    """Attention shape needed to permute fused QKV rows: ``H`` heads, ``G`` query groups, head dim ``d``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: ``G·(H/G + 2)·d``."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


@dataclass
class TargetFactor:
    """One target's update factor ``U_OR`` (bf16 ``[n_out, r]``, Megatron row order)."""

    name: str
    """Canonical target name (keys the projection), e.g. ``model.layers.3.mlp.gate_up_proj``."""
    U_OR: torch.Tensor
    n_in: int
    """Input features of the full layer (the projection's width)."""
    layout: str
    """One of :data:`LAYOUTS`; must equal :func:`expected_layout` of ``name``."""


@dataclass
class SketchDelta:
    """``W ← decay·W − U·A`` for every target and dense copies, moving ``base_version`` → ``new_version``."""

    base_version: int
    new_version: int
    seed: int
    update_index: int
    rank: int
    distribution: str
    targets: list[TargetFactor] = field(default_factory=list)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    """Trained non-target parameters, full (TP-gathered) tensors under HF names."""
    decay: float = 1.0
    """Decoupled weight decay factor applied to target weights before the low-rank step."""
    step: int = 0
    """The optimizer step this update is (keys the stochastic-rounding noise: fresh every update)."""
    rounding: str = "nearest"
    """How the merge rounds bf16 weights: ``nearest`` or ``stochastic`` (unbiased, with noise that is a
    pure function of the seed, target, ``step`` and the entry's canonical row and column: the
    trainer and every engine layout draw the same)."""
    attention: Optional[AttentionDims] = None
    """Required when a ``qkv_interleaved`` target is present."""
    chain: Optional[str] = None
    """The chain this delta continues: the epoch of the delta directory's newest anchor marker at or below
    ``base_version`` (set by :meth:`~megatron_logra.sync.transport.DirectoryTransport.publish`); None where no
    anchor applies (in process, SGLang). A consumer refuses a delta whose chain is not its anchor's."""
    format_version: int = FORMAT_VERSION
    checksum: Optional[str] = None
    """sha256 hex of the encoded message (set by ``encode`` and ``decode``)."""

    def payload_bytes(self) -> int:
        """Tensor bytes carried (U factors + dense), excluding the header."""
        n = sum(t.U_OR.numel() * t.U_OR.element_size() for t in self.targets)
        return n + sum(d.numel() * d.element_size() for d in self.dense.values())

    def header(self) -> dict:
        """The JSON-able header (everything but tensor bytes and the checksum)."""
        return {
            "format": MAGIC,
            "format_version": self.format_version,
            "base_version": self.base_version,
            "new_version": self.new_version,
            "seed": self.seed,
            "update_index": self.update_index,
            "step": self.step,
            "rank": self.rank,
            "distribution": self.distribution,
            "decay": float(self.decay),
            "rounding": self.rounding,
            "attention": None if self.attention is None else {
                "num_heads": self.attention.num_heads,
                "num_kv_heads": self.attention.num_kv_heads,
                "head_dim": self.attention.head_dim,
            },
            "targets": [{"name": t.name, "n_out": int(t.U_OR.shape[0]), "n_in": int(t.n_in), "layout": t.layout}
                        for t in self.targets],
            "dense": [{"name": k, "dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                      for k, v in sorted(self.dense.items())],
            "chain": self.chain,
        }

    def check_structure(self) -> None:
        """Raise :class:`SyncError` unless the message is well formed (no weights needed)."""
        check_header(self.header())
        for t in self.targets:
            if t.U_OR.dtype != torch.bfloat16:
                raise SyncError("dtype", f"U of {t.name} is {t.U_OR.dtype}, expected torch.bfloat16")
            if t.U_OR.dim() != 2 or t.U_OR.shape[1] != self.rank:
                raise SyncError("shape", f"U of {t.name} has shape {tuple(t.U_OR.shape)}, expected [n_out, {self.rank}]")
        for k, v in self.dense.items():
            if v.dtype not in DENSE_DTYPES.values():
                raise SyncError("dtype", f"dense tensor {k} is {v.dtype}; allowed {sorted(DENSE_DTYPES)}")


def _digest(header_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(f"{MAGIC}|".encode())
    h.update(header_json.encode())
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        h.update(f"|{key}|{t.dtype}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # reshape first: 0-d tensors too
    return h.hexdigest()


def _canonical_json(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def encode(delta: SketchDelta) -> bytes:
    """Serialise ``delta`` (checked first: raises :class:`SyncError` if malformed); sets ``delta.checksum``."""
    delta.check_structure()
    tensors: dict[str, torch.Tensor] = {}
    for t in delta.targets:
        tensors[f"U/{t.name}"] = t.U_OR.detach().cpu().contiguous()
    for k, v in delta.dense.items():
        tensors[f"dense/{k}"] = v.detach().cpu().contiguous()
    header = delta.header()
    delta.checksum = _digest(_canonical_json(header), tensors)
    data = st_save(tensors, metadata={_META_KEY: _canonical_json({"header": header, "sha256": delta.checksum})})
    logger.debug("encoded delta %d->%d: %d bytes", delta.base_version, delta.new_version, len(data))
    return data


def _read_safetensors_header(data: bytes) -> dict:
    """Parse the safetensors JSON header and check the byte length against it."""
    if len(data) < 8:
        raise SyncError("truncated", f"message of {len(data)} bytes is shorter than the 8-byte safetensors prefix")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise SyncError("truncated", f"safetensors header claims {n} bytes but only {len(data) - 8} follow")
    try:
        st_header = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, an int past Python's digit limit, deep nesting
        raise SyncError("malformed", f"safetensors header is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(st_header, dict):
        raise SyncError("malformed", "safetensors header is not a JSON object")
    # the sha256 covers the header's content, not its spelling: require the one spelling encode
    # writes (compact JSON, space padding to the next multiple of 8), so that whitespace, escapes and
    # padding cannot change unnoticed (the tensor-info order and data layout are not checked: they
    # carry no content, see the module docstring)
    try:
        canonical = json.dumps(st_header, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # an escape that decodes to a lone surrogate
        canonical = b""
    if data[8 : 8 + n].rstrip(b" ") != canonical or n - len(canonical) >= 8:
        raise SyncError("malformed", "safetensors header is not in canonical form (changed whitespace, escapes "
                                     "or padding)")
    end = 0
    try:
        for key, info in st_header.items():
            if key != "__metadata__":
                end = max(end, int(info["data_offsets"][1]))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SyncError("malformed", f"safetensors header entry is malformed ({exc!r})") from None
    if 8 + n + end > len(data):
        raise SyncError("truncated", f"tensor data needs {end} bytes but only {len(data) - 8 - n} are present")
    if 8 + n + end < len(data):
        raise SyncError("malformed", f"{len(data) - 8 - n - end} unexpected trailing bytes after the tensor data")
    return st_header


def decode(data: bytes) -> SketchDelta:
    """Parse and verify an encoded delta; raises :class:`SyncError` naming the first problem found."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SyncError("malformed", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    st_header = _read_safetensors_header(data)
    meta = st_header.get("__metadata__") or {}
    if not isinstance(meta, dict) or set(meta) != {_META_KEY}:
        raise SyncError("keys", f"metadata must hold exactly {_META_KEY!r}: not a sketch delta")
    try:
        outer = json.loads(meta[_META_KEY])
        header, claimed = outer["header"], outer["sha256"]
    except (ValueError, RecursionError, TypeError, KeyError) as exc:
        raise SyncError("checksum", f"delta metadata does not parse ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(header, dict) or not isinstance(claimed, str):
        raise SyncError("checksum", "delta header is not a JSON object with a sha256 string")
    if meta[_META_KEY] != _canonical_json(outer):  # e.g. 1.0 spelled 1e0: same numbers, other bytes
        raise SyncError("malformed", "delta metadata is not in canonical form (sorted keys, compact JSON)")
    if header.get("format_version") != FORMAT_VERSION or header.get("format") != MAGIC:
        check_header(header)  # raises the format_version error
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error type for malformed bytes
        raise SyncError("malformed", f"safetensors could not parse the message ({exc})") from None
    digest = _digest(_canonical_json(header), tensors)
    if digest != claimed:
        raise SyncError("checksum", f"sha256 mismatch: message says {claimed[:16]}…, content hashes to {digest[:16]}…")
    check_header(header)
    want = {f"U/{t['name']}" for t in header["targets"]} | {f"dense/{d['name']}" for d in header["dense"]}
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if missing or extra:
        raise SyncError("keys", f"tensor keys do not match the header: missing {missing}, extra {extra}")
    targets = []
    for t in header["targets"]:
        U_OR = tensors[f"U/{t['name']}"]
        if U_OR.dtype != torch.bfloat16:
            raise SyncError("dtype", f"U of {t['name']} is {U_OR.dtype}, expected torch.bfloat16")
        if tuple(U_OR.shape) != (t["n_out"], header["rank"]):
            raise SyncError("shape", f"U of {t['name']} has shape {tuple(U_OR.shape)}, header says {(t['n_out'], header['rank'])}")
        targets.append(TargetFactor(name=t["name"], U_OR=U_OR, n_in=t["n_in"], layout=t["layout"]))
    dense = {}
    for d in header["dense"]:
        v = tensors[f"dense/{d['name']}"]
        if v.dtype != DENSE_DTYPES[d["dtype"]] or list(v.shape) != d["shape"]:
            raise SyncError("shape", f"dense {d['name']}: {v.dtype} {list(v.shape)}, header says {d['dtype']} {d['shape']}")
        dense[d["name"]] = v
    att = header["attention"]
    return SketchDelta(
        base_version=header["base_version"], new_version=header["new_version"], seed=header["seed"],
        update_index=header["update_index"], rank=header["rank"], distribution=header["distribution"],
        targets=targets, dense=dense, decay=header["decay"], step=header["step"], rounding=header["rounding"],
        attention=None if att is None else AttentionDims(att["num_heads"], att["num_kv_heads"], att["head_dim"]),
        chain=header["chain"], format_version=header["format_version"], checksum=digest,
    )

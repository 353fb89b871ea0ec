"""Header schema of a sketch delta: constants, layout tags and the semantic header checks.

Works on the plain JSON header dict, so ``encode`` (before writing) and ``decode`` (after
reading) run the same checks. Imports only torch and ``megatron_logra.sketch``.
"""

from __future__ import annotations

import logging

import torch

from megatron_logra.sketch.naming import canonical_name
from megatron_logra.sketch.random_projection import DISTRIBUTIONS
from megatron_logra.sync.errors import SyncError

logger = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "MAGIC", "LAYOUTS", "DENSE_DTYPES", "expected_layout", "check_header"]

FORMAT_VERSION = 1
MAGIC = "logra-sketch-delta"
LAYOUTS = ("qkv_interleaved", "gate_up", "row_parallel", "plain")
DENSE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def expected_layout(name: str) -> str:
    """Layout tag a canonical target name must carry.

    ``qkv_interleaved`` (``...self_attn.qkv_proj``: Megatron rows, per query group
    ``[q heads; k; v]``), ``gate_up`` (``...mlp.gate_up_proj``: ``[gate; up]``), ``row_parallel``
    (``o_proj``/``down_proj``: engines shard A's columns), ``plain`` (anything else: unsharded).
    """
    if name.endswith(".self_attn.qkv_proj"):
        return "qkv_interleaved"
    if name.endswith(".mlp.gate_up_proj"):
        return "gate_up"
    if name.endswith(".self_attn.o_proj") or name.endswith(".mlp.down_proj"):
        return "row_parallel"
    return "plain"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_header(h: dict) -> None:
    """Semantic checks of a header dict (shared by encode and decode)."""
    if h.get("format") != MAGIC:
        raise SyncError("format_version", f"not a sketch delta (format={h.get('format')!r})")
    if h.get("format_version") != FORMAT_VERSION:
        raise SyncError("format_version", f"unknown format version {h.get('format_version')!r}; this reader knows {FORMAT_VERSION}")
    for key in ("base_version", "new_version", "seed", "update_index", "rank"):
        if not _is_int(h.get(key)):
            raise SyncError("keys", f"header field {key}={h.get(key)!r} must be an int")
    if h["base_version"] < 0 or h["new_version"] <= h["base_version"]:
        raise SyncError("version", f"new_version={h['new_version']} must be > base_version={h['base_version']} >= 0")
    if h["rank"] < 1 or h["update_index"] < 0:
        raise SyncError("keys", f"rank={h['rank']} must be >= 1 and update_index={h['update_index']} >= 0")
    if h.get("distribution") not in DISTRIBUTIONS:
        raise SyncError("keys", f"unknown distribution {h.get('distribution')!r}; expected one of {DISTRIBUTIONS}")
    if not isinstance(h.get("decay"), float) or not (0.0 < h["decay"] <= 1.0):
        raise SyncError("keys", f"decay={h.get('decay')!r} must be a float in (0, 1]")
    att = h.get("attention")
    if att is not None:
        if not all(_is_int(att.get(k)) and att[k] > 0 for k in ("num_heads", "num_kv_heads", "head_dim")):
            raise SyncError("keys", f"attention dims {att!r} must be positive ints")
        if att["num_heads"] % att["num_kv_heads"]:
            raise SyncError("keys", f"num_heads={att['num_heads']} is not a multiple of num_kv_heads={att['num_kv_heads']}")
    names = [t.get("name") for t in h.get("targets", [])]
    if len(set(names)) != len(names):
        raise SyncError("name", f"duplicate target names in {names}")
    for t in h.get("targets", []):
        name = t.get("name")
        if not isinstance(name, str) or canonical_name(name) != name:
            raise SyncError("name", f"target name {name!r} is not canonical (expected {canonical_name(str(name))!r})")
        if t.get("layout") != expected_layout(name):
            raise SyncError("layout", f"target {name} has layout {t.get('layout')!r}, expected {expected_layout(name)!r}")
        if not (_is_int(t.get("n_in")) and _is_int(t.get("n_out")) and t["n_in"] >= 1 and t["n_out"] >= 1):
            raise SyncError("shape", f"target {name}: n_in={t.get('n_in')!r}, n_out={t.get('n_out')!r} must be positive ints")
        if t["layout"] == "qkv_interleaved":
            if att is None:
                raise SyncError("layout", f"target {name} needs attention dims in the header")
            rows = (att["num_heads"] + 2 * att["num_kv_heads"]) * att["head_dim"]
            if t["n_out"] != rows:
                raise SyncError("shape", f"target {name} has {t['n_out']} rows, attention dims {att} imply {rows}")
        if t["layout"] == "gate_up" and t["n_out"] % 2:
            raise SyncError("shape", f"target {name} ([gate; up]) has an odd number of rows {t['n_out']}")
    for d in h.get("dense", []):
        if d.get("dtype") not in DENSE_DTYPES or not isinstance(d.get("shape"), list):
            raise SyncError("dtype", f"dense entry {d!r} has an unsupported dtype or shape")

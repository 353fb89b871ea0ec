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

__all__ = ["FORMAT_VERSION", "MAGIC", "LAYOUTS", "DENSE_DTYPES", "HEADER_KEYS", "ROUNDINGS", "expected_layout",
           "check_header"]

FORMAT_VERSION = 6
"""6: the header names the ``chain`` it continues (a delta directory's anchor epoch, or null), so that a consumer
refuses a delta of another run or an abandoned trajectory whose versions happen to fit; 5: the stochastic-rounding noise of entry ``(i, j)`` is a row hash XOR a column hash (4 hashed every
entry twice: the same statistics at ~25 passes over the weight more); 4: a Rademacher merge subtracts ``grid(s·U)·sign(A)`` (the scale folded into the factor, so one BLAS
call can do the merge; 3 subtracted ``s·(U·sign(A))``: other bits); 3: the header carries the optimizer ``step``, which keys the stochastic-rounding noise (2 keyed it by
the projection's update index, which repeats without ``logra.refresh``); 2: the header names the merge's ``rounding`` of bf16 weights (1 had
none: always to nearest)."""
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


HEADER_KEYS = frozenset({"format", "format_version", "base_version", "new_version", "seed", "update_index", "step",
                         "rank", "distribution", "decay", "rounding", "attention", "targets", "dense", "chain"})
ROUNDINGS = ("nearest", "stochastic")
"""How the merge rounds a bf16 weight (fp16 weights: always to nearest; fp32: no rounding)."""
ATTENTION_KEYS = frozenset({"num_heads", "num_kv_heads", "head_dim"})
TARGET_KEYS = frozenset({"name", "n_out", "n_in", "layout"})
DENSE_KEYS = frozenset({"name", "dtype", "shape"})


def _check_keys(obj, keys: frozenset, what: str) -> None:
    """``obj`` is a JSON object with exactly ``keys`` (a reader that dropped unknown fields could
    apply something other than what was sent)."""
    if not isinstance(obj, dict):
        raise SyncError("keys", f"{what} must be a JSON object, got {type(obj).__name__}")
    if set(obj) != keys:
        missing, extra = sorted(keys - set(obj)), sorted(set(obj) - keys)
        raise SyncError("keys", f"{what} fields do not match format {FORMAT_VERSION}: missing {missing}, extra {extra}")


def check_header(h: dict) -> None:
    """Semantic checks of a header dict (shared by encode and decode): exactly the known fields,
    each of its JSON type, then the values. Raises :class:`SyncError`, never anything else."""
    if not isinstance(h, dict) or h.get("format") != MAGIC:
        raise SyncError("format_version", f"not a sketch delta (format={h.get('format') if isinstance(h, dict) else h!r})")
    if not _is_int(h.get("format_version")) or h["format_version"] != FORMAT_VERSION:
        raise SyncError("format_version", f"unknown format version {h.get('format_version')!r}; this reader knows {FORMAT_VERSION}")
    _check_keys(h, HEADER_KEYS, "the header")
    for key in ("base_version", "new_version", "seed", "update_index", "step", "rank"):
        if not _is_int(h.get(key)):
            raise SyncError("keys", f"header field {key}={h.get(key)!r} must be an int")
    if h["base_version"] < 0 or h["new_version"] <= h["base_version"]:
        raise SyncError("version", f"new_version={h['new_version']} must be > base_version={h['base_version']} >= 0")
    if h["rank"] < 1 or h["update_index"] < 0 or h["step"] < 0:
        raise SyncError("keys", f"rank={h['rank']} must be >= 1, update_index={h['update_index']} and "
                                f"step={h['step']} >= 0")
    if not isinstance(h["distribution"], str) or h["distribution"] not in DISTRIBUTIONS:
        raise SyncError("keys", f"unknown distribution {h.get('distribution')!r}; expected one of {DISTRIBUTIONS}")
    if not isinstance(h.get("decay"), float) or not (0.0 < h["decay"] <= 1.0):
        raise SyncError("keys", f"decay={h.get('decay')!r} must be a float in (0, 1]")
    chain = h.get("chain")
    if chain is not None and (not isinstance(chain, str) or not chain or len(chain) > 64 or not chain.isalnum()):
        raise SyncError("keys", f"chain={str(chain)[:80]!r} must be null or an anchor epoch id (up to 64 letters "
                                f"and digits)")
    if not isinstance(h.get("rounding"), str) or h["rounding"] not in ROUNDINGS:
        raise SyncError("keys", f"unknown rounding {h.get('rounding')!r}; expected one of {ROUNDINGS}")
    att = h["attention"]
    if att is not None:
        _check_keys(att, ATTENTION_KEYS, "attention")
        if not all(_is_int(att[k]) and att[k] > 0 for k in ATTENTION_KEYS):
            raise SyncError("keys", f"attention dims {att!r} must be positive ints")
        if att["num_heads"] % att["num_kv_heads"]:
            raise SyncError("keys", f"num_heads={att['num_heads']} is not a multiple of num_kv_heads={att['num_kv_heads']}")
    for field in ("targets", "dense"):
        if not isinstance(h[field], list):
            raise SyncError("keys", f"header field {field} must be a JSON list, got {type(h[field]).__name__}")
    for i, t in enumerate(h["targets"]):
        _check_keys(t, TARGET_KEYS, f"target {i}")
        name = t["name"]
        try:
            canonical = canonical_name(name) if isinstance(name, str) else None
        except ValueError:  # e.g. a layer index past Python's int digit limit
            canonical = None
        if canonical is None or canonical != name:
            raise SyncError("name", f"target name {str(name)[:120]!r} is not canonical"
                            + (f" (expected {canonical!r})" if canonical else ""))
    names = [t["name"] for t in h["targets"]]
    if len(set(names)) != len(names):
        raise SyncError("name", f"duplicate target names in {names}")
    for t in h["targets"]:
        name = t["name"]
        if t["layout"] != expected_layout(name):
            raise SyncError("layout", f"target {name} has layout {t['layout']!r}, expected {expected_layout(name)!r}")
        if not (_is_int(t["n_in"]) and _is_int(t["n_out"]) and t["n_in"] >= 1 and t["n_out"] >= 1):
            raise SyncError("shape", f"target {name}: n_in={t['n_in']!r}, n_out={t['n_out']!r} must be positive ints")
        if t["layout"] == "qkv_interleaved":
            if att is None:
                raise SyncError("layout", f"target {name} needs attention dims in the header")
            rows = (att["num_heads"] + 2 * att["num_kv_heads"]) * att["head_dim"]
            if t["n_out"] != rows:
                raise SyncError("shape", f"target {name} has {t['n_out']} rows, attention dims {att} imply {rows}")
        if t["layout"] == "gate_up" and t["n_out"] % 2:
            raise SyncError("shape", f"target {name} ([gate; up]) has an odd number of rows {t['n_out']}")
    for i, d in enumerate(h["dense"]):
        _check_keys(d, DENSE_KEYS, f"dense entry {i}")
        if not isinstance(d["name"], str) or not d["name"]:
            raise SyncError("name", f"dense entry {i} has name {d['name']!r}; expected a non-empty string")
        # any rank, [] (a 0-d scalar parameter) and zero-size dimensions included: the apply copies the whole tensor
        shape_ok = isinstance(d["shape"], list) and all(_is_int(n) and n >= 0 for n in d["shape"])
        if not isinstance(d["dtype"], str) or d["dtype"] not in DENSE_DTYPES or not shape_ok:
            raise SyncError("dtype", f"dense entry {d!r} has an unsupported dtype or shape")
    dense_names = [d["name"] for d in h["dense"]]
    if dense_names != sorted(set(dense_names)):
        raise SyncError("name", f"dense names must be unique and sorted: {dense_names}")

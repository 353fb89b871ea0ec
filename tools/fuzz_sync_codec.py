#!/usr/bin/env python
"""Fuzz the sketch-delta codec: random messages, random corruptions, every outcome accounted for.

    python tools/fuzz_sync_codec.py                          # 20000 messages, seed 0
    python tools/fuzz_sync_codec.py --messages 500 --seed 7 --max-seconds 60
    python tools/fuzz_sync_codec.py --seed 0 --start 1234 --messages 1 --dump /tmp/fuzz   # replay one message

Per message (its own ``random.Random("<seed>/<index>")``, so any message replays alone with
``--start``): a random valid :class:`~megatron_logra.sync.codec.SketchDelta` (canonical target
names with their layouts, fused QKV consistent with the attention dims, bf16 factors on
``quantize_factor``'s grid or arbitrary bit patterns, dense tensors of every allowed dtype,
huge versions and seeds, any decay in (0, 1]). Checks:

* the valid message round-trips exactly (fields with their types, tensors bit for bit),
  re-encodes to the same bytes, and carries the documented sha256;
* ``--corruptions`` corruptions of it (kinds taken in turn), each decoded:

  ============================  =====================================================
  ``byte_flip``                  one byte xor a non-zero mask: must raise
  ``multi_flip``                 2-16 flips: must raise
  ``truncate``                   a proper prefix: must raise ``truncated``
  ``extend``                     1-64 bytes appended: must raise ``malformed``
  ``garbage``                    random bytes, sometimes behind a real prefix: must raise
  ``respell``                    same JSON meaning, other bytes (padding, spaces,
                                 escapes, number spelling): must raise
  ``header_edit``                a header value changed, old sha256 kept: must raise
  ``header_edit_rehash``         a header value changed (same JSON type), sha256
                                 recomputed: must raise or decode to exactly that message
  ``header_edit_rehash_illtyped``  a header value of another JSON type or a key removed,
                                 sha256 recomputed: must raise ``SyncError`` or decode to
                                 exactly that message
  ``header_edit_rehash_extra``   an unknown key added or a target / dense entry listed
                                 twice, sha256 recomputed: must raise (a SketchDelta
                                 cannot hold it; a reader that dropped it would apply
                                 something other than what was sent)
  ``swap_tensors``               two tensors' bytes exchanged, old sha256: must raise
  ``swap_tensors_rehash``        the same with the sha256 recomputed: must raise or
                                 decode to exactly the swapped message
  ============================  =====================================================

  A draw that changes nothing is not a corruption and is drawn again (at most ``MAX_DRAWS``
  times, then left out): the same bytes (cancelling flips, a value set to what it was, two
  equal tensors swapped), or a header / tensor edit that leaves the header (dense entries in
  any order) and every tensor as they were (an empty list "left empty"). The corruption
  counts hold only real corruptions; the redraws are reported beside them.

Failures: a valid message that does not round-trip, any exception other than ``SyncError``,
a decoded message that differs from what the bytes hold, a truncation not labelled
``truncated`` or an extension not ``malformed``, and (``--lenient`` turns this off) a
corruption that decodes at all although it was not re-hashed by construction. Prints a table
per corruption kind and per ``SyncError`` kind, the first failures with the command that
replays them, and exits 1 on any failure. ``--dump DIR`` writes each failing message's bytes.
Torch, safetensors and the standard library only (no hypothesis).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from megatron_logra.sketch.random_projection import DISTRIBUTIONS
from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor, decode, encode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import quantize_factor
from megatron_logra.sync.schema import DENSE_DTYPES, LAYOUTS, MAGIC, expected_layout

META_KEY = "logra.delta"
KINDS = ("byte_flip", "multi_flip", "truncate", "extend", "garbage", "respell", "header_edit",
         "header_edit_rehash", "header_edit_rehash_illtyped", "header_edit_rehash_extra", "swap_tensors",
         "swap_tensors_rehash")
OUTCOMES = ("rejected", "accepted_exact", "accepted_identical", "silent", "crash")
"""``rejected``: SyncError; ``accepted_exact``: decoded exactly what a re-hashed (valid) message
holds; ``accepted_identical``: a corruption decoded to the original (undetected, harmless);
``silent``: decoded something the bytes do not hold; ``crash``: another exception."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LAYER_SUFFIXES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "mlp.router")
_DENSE_NAMES = ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight",
                "model.layers.0.input_layernorm.weight", "model.layers.2.self_attn.q_proj.bias",
                "model.layers.1.mlp.down_proj.bias", "naïve/ünïcode ☃", "quote\"back\\slash", "tab\tnew\nline")
_SPECIAL = (0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), float("nan"), 1e-40, 3e38, 2.0**-126)
_ILL_TYPED = (None, True, False, "x", [], {}, 1.5, [1], {"name": 1}, -0.0)
_NULLABLE = {("chain",): (type(None), str), ("attention",): (type(None), dict)}
"""Header fields that take null or a value of one type: an ill-typed edit of one is neither of them."""


# --------------------------------------------------------------------------- random valid deltas


def _tensor(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    kind = rng.choice(("grid", "normal", "bits", "zeros", "special"))
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "bits":
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(-(2 ** (8 * size - 1)), 2 ** (8 * size - 1), shape, dtype=torch.int64, generator=gen)
        return raw.to(_INT_OF_SIZE[size]).view(dtype)
    if kind == "special":
        idx = torch.randint(0, len(_SPECIAL), shape, generator=gen)
        return torch.tensor(_SPECIAL, dtype=torch.float64)[idx].to(dtype)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0 ** rng.randint(-30, 4)
    if kind == "grid" and dtype == torch.bfloat16 and len(shape) == 2 and shape[1] >= 1:
        return quantize_factor(x.float())
    return x.to(dtype)


def random_delta(rng: random.Random) -> SketchDelta:
    """A valid random delta (``encode`` accepts it); dense tensors of 0-3 dims."""
    rank = rng.randint(1, 8)
    names = [f"model.layers.{i}.{s}" for i in rng.sample(range(64), rng.randint(0, 2))
             for s in _LAYER_SUFFIXES if rng.random() < 0.6]
    names += [n for n in ("lm_head", "model.embed_tokens") if rng.random() < 0.15]
    rng.shuffle(names)
    attention = None
    if any(expected_layout(n) == "qkv_interleaved" for n in names) or rng.random() < 0.3:
        groups = rng.randint(1, 4)
        attention = AttentionDims(groups * rng.randint(1, 3), groups, rng.randint(1, 4))
    targets = []
    for name in names:
        layout = expected_layout(name)
        n_out = (attention.qkv_rows if layout == "qkv_interleaved" else  # type: ignore[union-attr]
                 2 * rng.randint(1, 8) if layout == "gate_up" else rng.randint(1, 12))
        targets.append(TargetFactor(name, _tensor(rng, (n_out, rank), torch.bfloat16), rng.randint(1, 1 << 16), layout))
    dense = {}
    for _ in range(rng.randint(0, 3)):
        name = rng.choice(_DENSE_NAMES) if rng.random() < 0.8 else "".join(
            chr(rng.choice((rng.randint(32, 126), rng.randint(0xA0, 0x2FFF), rng.randint(0x10000, 0x1F6FF))))
            for _ in range(rng.randint(1, 8)))
        dims = rng.randint(0, 3)
        shape = tuple(rng.randint(0, 5) for _ in range(dims))
        dense[name] = _tensor(rng, shape, DENSE_DTYPES[rng.choice(sorted(DENSE_DTYPES))])
    base = rng.choice((0, 1, rng.randint(0, 2**40), 2**62))
    return SketchDelta(
        base_version=base, new_version=base + rng.choice((1, rng.randint(1, 2**40))), seed=rng.getrandbits(64),
        update_index=rng.choice((0, rng.randint(0, 2**31))), step=rng.choice((0, rng.randint(1, 2**40))), rank=rank, distribution=rng.choice(DISTRIBUTIONS),
        targets=targets, dense=dense, decay=rng.choice((1.0, 1.0 - 2.0**-24, rng.random() or 1.0, 5e-324)),
        rounding=rng.choice(("nearest", "stochastic")), attention=attention,
        chain=rng.choice((None, f"{rng.getrandbits(128):032x}")),
    )


# --------------------------------------------------------------------------- the wire format, written out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def reference_digest(header: Any, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of ``MAGIC|``, the canonical header JSON, and per tensor (sorted keys) ``|key|dtype|shape|`` + bytes."""
    h = hashlib.sha256(f"{MAGIC}|".encode())
    h.update(canonical_json(header).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"|{key}|{t.dtype}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(_bits(t).reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def split_message(data: bytes) -> tuple[dict, bytes, bytes]:
    """``(safetensors header dict, its JSON bytes as written, tensor bytes)`` of a well-formed message."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 : 8 + n], data[8 + n :]


def unpack(data: bytes) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(delta header, tensors)`` of a well-formed message."""
    st_header, _, _ = split_message(data)
    return json.loads(st_header["__metadata__"][META_KEY])["header"], st_load(data)


def pack(header: Any, tensors: dict[str, torch.Tensor], sha256: Optional[str] = None) -> bytes:
    """A message holding ``header`` and ``tensors``, claiming ``sha256`` (default: the right one)."""
    sha256 = reference_digest(header, tensors) if sha256 is None else sha256
    return st_save(tensors, metadata={META_KEY: canonical_json({"header": header, "sha256": sha256})})


def rebuild(st_header_json: bytes, body: bytes) -> bytes:
    """A safetensors file from raw header JSON bytes (space-padded to 8) and the tensor bytes."""
    padded = st_header_json + b" " * (-len(st_header_json) % 8)
    return struct.pack("<Q", len(padded)) + padded + body


# --------------------------------------------------------------------------- corruptions


@dataclass
class Corruption:
    """Corrupted bytes and what decoding them may give."""

    data: bytes
    description: str
    rehashed: bool = False
    """A valid message by construction: it may decode, to exactly ``expect``."""
    expect: Optional[tuple[Any, dict[str, torch.Tensor]]] = None
    """``(header, tensors)`` a rehashed message holds (None: the original's)."""
    error_kind: Optional[str] = None
    """The SyncError kind it must raise, if one is required."""
    same_meaning: bool = False
    """The edit left the header (dense entries in any order) and every tensor as they were: no corruption."""


_Path = tuple[Any, ...]


def _paths(header: dict) -> list[_Path]:
    paths: list[_Path] = [(k,) for k in header]
    for list_key in ("targets", "dense"):
        for i, entry in enumerate(header[list_key]):
            paths += [(list_key, i, k) for k in entry]
    if isinstance(header.get("attention"), dict):
        paths += [("attention", k) for k in header["attention"]]
    return paths


def _parent(header: dict, path: _Path) -> Any:
    node = header
    for key in path[:-1]:
        node = node[key]
    return node


def _well_typed(rng: random.Random, old: Any) -> Any:
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return rng.choice((old + 1, old - 1, 0, -1, 2**63, 2**64, rng.randint(-10, 10**6)))
    if isinstance(old, float):
        return rng.choice((old / 2, -old, 0.0, 1.5, rng.random(), 1e-300, old + 2.0**-30))
    if isinstance(old, str):
        return rng.choice((old + "x", old[:-1], old.upper(), "", old.replace(".", "_", 1), rng.choice(LAYOUTS),
                           rng.choice(DISTRIBUTIONS), rng.choice(sorted(DENSE_DTYPES)), "int8", MAGIC,
                           "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_up_proj"))
    if isinstance(old, list):
        new = list(old)
        choice = rng.randrange(3)
        if choice == 0 or not new:
            new.append(rng.randint(0, 6))
        elif choice == 1:
            new.pop(rng.randrange(len(new)))
        else:
            new[rng.randrange(len(new))] = rng.choice((-1, 0, 1, 2, 7))
        return new
    if isinstance(old, dict):  # attention dims
        return rng.choice((None, {k: rng.randint(0, 5) for k in ("num_heads", "num_kv_heads", "head_dim")}))
    return {k: rng.randint(1, 4) for k in ("num_heads", "num_kv_heads", "head_dim")}  # old is None


def _edit_header(rng: random.Random, header: dict, how: str) -> str:
    """Edit ``header`` in place, ``how`` = ``well_typed`` | ``ill_typed`` | ``extra``; describe the edit."""
    if how == "extra":
        lists = [k for k in ("targets", "dense") if header[k]]
        if lists and rng.random() < 0.3:
            key = rng.choice(lists)
            i = rng.randrange(len(header[key]))
            header[key].append(json.loads(json.dumps(header[key][i])))
            return f"{key}[{i}] listed twice"
        path = rng.choice(_paths(header))
        _parent(header, path)["unexpected"] = rng.choice(_ILL_TYPED)
        return f"add key 'unexpected' beside {path}"
    path = rng.choice(_paths(header))
    parent, leaf = _parent(header, path), path[-1]
    if how == "ill_typed":
        if rng.random() < 0.4:
            del parent[leaf]
            return f"remove {path}"
        allowed = _NULLABLE.get(path, (type(parent[leaf]),))  # a value of another type the field takes is no error
        new = rng.choice([v for v in _ILL_TYPED if type(v) not in allowed])
    elif path in (("targets",), ("dense",)):
        entries = parent[leaf]
        if len(entries) >= 2 and rng.random() < 0.5:
            entries.reverse()
            return f"reverse {leaf}"
        if entries:
            i = rng.randrange(len(entries))
            entries.pop(i)
            return f"drop {leaf}[{i}]"
        return f"{leaf} left empty"
    else:
        new = _well_typed(rng, parent[leaf])
    parent[leaf] = new
    return f"set {path} = {new!r}"


def _respell(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """The same JSON meaning in other bytes."""
    st_header, raw, body = split_message(data)
    how = rng.randrange(5)
    pad = len(raw) - len(raw.rstrip(b" "))
    if how == 0 and pad:
        i = 8 + len(raw) - 1 - rng.randrange(pad)
        ws = rng.choice(b"\t\n\r")
        return data[:i] + bytes([ws]) + data[i + 1 :], f"padding byte {i} -> {ws:#04x}"
    if how in (1, 2):
        spelled = (json.dumps(st_header, ensure_ascii=False) if how == 1 else
                   json.dumps(st_header, separators=(",", ":"))).encode()
        if spelled == raw.rstrip(b" "):  # nothing to escape: indent instead
            spelled = json.dumps(st_header, indent=1).encode()
        return rebuild(spelled, body), ("safetensors header with spaces" if how == 1 else
                                        "safetensors header ascii-escaped")
    meta = json.loads(st_header["__metadata__"][META_KEY])
    if how == 3:
        spelled = json.dumps(meta, sort_keys=True)
        desc = "metadata with spaces"
    else:
        canon = canonical_json(meta)
        spelled = canon.replace(".0,", "e0,", 1).replace(".0}", "e0}", 1) if ".0" in canon else json.dumps(
            meta, separators=(",", ":"))  # unsorted keys
        desc = "metadata numbers respelled" if ".0" in canon else "metadata keys unsorted"
    if spelled == canonical_json(meta):
        spelled = json.dumps(meta, sort_keys=True, indent=1)
    st_header["__metadata__"][META_KEY] = spelled
    return rebuild(json.dumps(st_header, separators=(",", ":"), ensure_ascii=False).encode(), body), desc


def corrupt(kind: str, rng: random.Random, data: bytes) -> Corruption:
    """One corruption of kind ``kind`` of the valid message ``data``. It may be a no-op (the same bytes, or a
    header / tensor edit that changes nothing, ``same_meaning``): :func:`run` draws again then."""
    n = len(data)
    if kind == "byte_flip":
        pos, mask = rng.randrange(n), rng.randint(1, 255)
        return Corruption(data[:pos] + bytes([data[pos] ^ mask]) + data[pos + 1 :], f"byte {pos} ^= {mask:#04x}")
    if kind == "multi_flip":
        bad = bytearray(data)
        flips = [(rng.randrange(n), rng.randint(1, 255)) for _ in range(rng.randint(2, 16))]
        for pos, mask in flips:
            bad[pos] ^= mask
        return Corruption(bytes(bad), f"flips {flips}")
    if kind == "truncate":
        cut = rng.choice((rng.randrange(n), n - 1, rng.randrange(min(n, 16))))
        return Corruption(data[:cut], f"first {cut} of {n} bytes", error_kind="truncated")
    if kind == "extend":
        extra = rng.randbytes(rng.randint(1, 64))
        return Corruption(data + extra, f"{len(extra)} bytes appended", error_kind="malformed")
    if kind == "garbage":
        junk = rng.randbytes(rng.randint(0, 2048))
        if rng.random() < 0.5:
            keep = rng.randrange(n)
            return Corruption(data[:keep] + junk, f"first {keep} bytes + {len(junk)} random bytes")
        return Corruption(junk, f"{len(junk)} random bytes")
    if kind == "respell":
        bad, desc = _respell(rng, data)
        return Corruption(bad, desc)
    header, tensors = unpack(data)
    c = _edit(kind, rng, data, header, tensors)
    original_header, original_tensors = unpack(data)
    c.same_meaning = (_normal_header(header) == _normal_header(original_header) and set(tensors) == set(original_tensors)
                      and all(_same_tensor(tensors[k], original_tensors[k]) for k in tensors))
    return c


def _edit(kind: str, rng: random.Random, data: bytes, header: Any, tensors: dict[str, torch.Tensor]) -> Corruption:
    """The header / tensor edits of :func:`corrupt` (``header`` and ``tensors`` are edited in place)."""
    if kind.startswith("header_edit"):
        desc = _edit_header(rng, header, {"header_edit": "well_typed", "header_edit_rehash": "well_typed",
                                          "header_edit_rehash_illtyped": "ill_typed",
                                          "header_edit_rehash_extra": "extra"}[kind])
        if kind == "header_edit":
            _, claimed = _claimed(data)
            return Corruption(pack(header, tensors, claimed), desc + " (old sha256)")
        return Corruption(pack(header, tensors), desc + " (sha256 recomputed)", rehashed=True, expect=(header, tensors))
    if kind in ("swap_tensors", "swap_tensors_rehash"):
        keys = sorted(tensors)
        if len(keys) < 2:  # nothing to swap with: put the one tensor under a second name instead
            tensors[(keys[0] if keys else "U/none") + "_copy"] = tensors[keys[0]].clone() if keys else torch.zeros(1)
            desc = "tensor duplicated under a new key"
        else:
            a, b = rng.sample(keys, 2)
            tensors[a], tensors[b] = tensors[b], tensors[a]
            desc = f"swap {a!r} <-> {b!r}"
        if kind == "swap_tensors":
            return Corruption(pack(header, tensors, _claimed(data)[1]), desc + " (old sha256)")
        return Corruption(pack(header, tensors), desc + " (sha256 recomputed)", rehashed=True, expect=(header, tensors))
    raise ValueError(f"unknown corruption kind {kind!r}")


def _claimed(data: bytes) -> tuple[dict, str]:
    st_header, _, _ = split_message(data)
    outer = json.loads(st_header["__metadata__"][META_KEY])
    return outer["header"], outer["sha256"]


# --------------------------------------------------------------------------- comparing decoded messages


def _normal_header(header: Any) -> str:
    """Canonical JSON with the dense entries in a fixed order (a dict on the decoded side)."""
    if isinstance(header, dict) and isinstance(header.get("dense"), list):
        header = dict(header, dense=sorted(header["dense"], key=canonical_json))
    return canonical_json(header)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def holds(delta: SketchDelta, header: Any, tensors: dict[str, torch.Tensor]) -> Optional[str]:
    """None if decoded ``delta`` is exactly ``header`` + ``tensors``, else what differs."""
    got, sent = _normal_header(delta.header()), _normal_header(header)
    if got != sent:
        i = next((i for i, (a, b) in enumerate(zip(got, sent)) if a != b), min(len(got), len(sent)))
        lo = max(0, i - 40)
        return f"header differs at char {i}: decoded ...{got[lo:i + 40]}... vs sent ...{sent[lo:i + 40]}..."
    mine = {f"U/{t.name}": t.U_OR for t in delta.targets} | {f"dense/{k}": v for k, v in delta.dense.items()}
    if set(mine) != set(tensors):
        return f"tensor keys differ: {sorted(set(mine) ^ set(tensors))[:6]}"
    bad = [k for k in mine if not _same_tensor(mine[k], tensors[k])]
    if bad:
        return f"tensor bytes differ: {bad[:6]}"
    for t in delta.targets:  # header() is built from the fields: check the field types as well
        if not (isinstance(t.n_in, int) and t.layout in LAYOUTS):
            return f"target {t.name}: n_in={t.n_in!r}, layout={t.layout!r}"
    return None


def round_trip_problem(delta: SketchDelta, data: bytes, decode_fn: Callable[[bytes], SketchDelta]) -> Optional[str]:
    """None if the valid ``data`` (``encode(delta)``) decodes to ``delta`` exactly and re-encodes to itself."""
    got = decode_fn(data)
    for f in ("base_version", "new_version", "seed", "update_index", "rank", "distribution", "decay", "rounding",
              "attention", "format_version"):
        a, b = getattr(got, f), getattr(delta, f)
        if type(a) is not type(b) or a != b:
            return f"field {f}: decoded {a!r}, sent {b!r}"
    if [(t.name, t.n_in, t.layout) for t in got.targets] != [(t.name, t.n_in, t.layout) for t in delta.targets]:
        return "targets differ"
    if any(not _same_tensor(a.U_OR, b.U_OR) for a, b in zip(got.targets, delta.targets)):
        return "factor bits differ"
    if sorted(got.dense) != sorted(delta.dense) or any(not _same_tensor(got.dense[k], v)
                                                       for k, v in delta.dense.items()):
        return "dense tensors differ"
    header, tensors = unpack(data)
    if got.checksum != reference_digest(header, tensors) or delta.checksum != got.checksum:
        return "checksum is not the documented sha256"
    if encode(got) != data:
        return "re-encoding the decoded message gives other bytes"
    return None


# --------------------------------------------------------------------------- the run


@dataclass
class Summary:
    """Counts of one fuzz run (each corrupted message has exactly one outcome)."""

    messages: int = 0
    valid_ok: int = 0
    outcomes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    """corruption kind -> outcome -> count."""
    error_kinds: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    """corruption kind -> SyncError kind -> count."""
    wrong_kind: Counter = field(default_factory=Counter)
    """corruption kind -> rejections with another SyncError kind than required."""
    redrawn: Counter = field(default_factory=Counter)
    """corruption kind -> no-op edits drawn again (the same bytes, or the same header and tensors)."""
    no_op: Counter = field(default_factory=Counter)
    """corruption kind -> corruptions left out because ``MAX_DRAWS`` draws in a row were all no-ops."""
    failures: list[str] = field(default_factory=list)
    failure_counts: Counter = field(default_factory=Counter)
    """what failed (``roundtrip``, ``silent``, ``crash``, ``wrong_kind``, ``undetected``) -> count."""
    seconds: float = 0.0
    stopped_early: bool = False

    @property
    def corrupted(self) -> int:
        """Corrupted messages decoded: each really differs from its valid message (no-ops are redrawn)."""
        return sum(sum(c.values()) for c in self.outcomes.values())

    @property
    def failed(self) -> int:
        return sum(self.failure_counts.values())

    def exit_code(self) -> int:
        return 1 if self.failed else 0


MAX_DRAWS = 32
"""Draws of one corruption before it is left out as a no-op (counted in ``Summary.no_op``)."""


def run(messages: int = 20000, seed: int = 0, *, start: int = 0, corruptions: int = 3,
        kinds: Sequence[str] = KINDS, max_seconds: Optional[float] = None, strict: bool = True,
        decode_fn: Callable[[bytes], SketchDelta] = decode,
        dump: Optional[Path] = None, keep_failures: int = 20) -> Summary:
    """Fuzz ``decode_fn`` with ``messages`` random deltas and ``corruptions`` corruptions of each."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"unknown corruption kinds {unknown}; choose from {KINDS}")
    summary = Summary()
    t0 = time.perf_counter()
    replay = f"python tools/fuzz_sync_codec.py --seed {seed} --messages 1"
    if corruptions != 3:
        replay += f" --corruptions {corruptions}"
    if tuple(kinds) != KINDS:
        replay += f" --kinds {','.join(kinds)}"

    shown: Counter = Counter()

    def fail(what: str, index: int, text: str, data: Optional[bytes] = None, kind: str = "valid") -> None:
        summary.failure_counts[what] += 1
        shown[what, kind] += 1
        if len(summary.failures) < keep_failures and shown[what, kind] <= 3:  # a few of each sort
            summary.failures.append(f"[{what}] message {index} ({kind}): {text}\n    replay: {replay} --start {index}")
        if dump is not None and data is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"seed{seed}-msg{index}-{kind}-{summary.failure_counts[what]}.bin").write_bytes(data)

    for index in range(start, start + messages):
        if max_seconds is not None and summary.messages and time.perf_counter() - t0 > max_seconds:
            summary.stopped_early = True
            break
        rng = random.Random(f"{seed}/{index}")
        delta = random_delta(rng)
        summary.messages += 1
        try:
            data = encode(delta)
            problem = round_trip_problem(delta, data, decode_fn)
        except Exception as exc:  # noqa: BLE001 - every exception is a finding here
            fail("roundtrip", index, f"{type(exc).__name__}: {exc}")
            continue
        if problem:
            fail("roundtrip", index, problem, data)
            continue
        summary.valid_ok += 1
        for j in range(corruptions):
            kind = kinds[(index * corruptions + j) % len(kinds)]
            for _ in range(MAX_DRAWS):  # an edit that changed nothing is not a corruption: draw again
                c = corrupt(kind, rng, data)
                if c.data != data and not c.same_meaning:
                    break
                summary.redrawn[kind] += 1
            else:
                summary.no_op[kind] += 1
                continue
            try:
                got = decode_fn(c.data)
            except SyncError as exc:
                summary.outcomes[kind]["rejected"] += 1
                summary.error_kinds[kind][exc.kind] += 1
                if c.error_kind is not None and exc.kind != c.error_kind:
                    summary.wrong_kind[kind] += 1
                    fail("wrong_kind", index, f"{c.description}: {exc} (expected kind {c.error_kind!r})", c.data, kind)
                continue
            except Exception as exc:  # noqa: BLE001
                summary.outcomes[kind]["crash"] += 1
                fail("crash", index, f"{c.description}: {type(exc).__name__}: {exc}", c.data, kind)
                continue
            expect = c.expect if c.expect is not None else unpack(data)
            try:
                diff = holds(got, *expect)
            except Exception as exc:  # noqa: BLE001 - a decoded message that cannot even describe itself
                diff = f"decoded message is unusable: {type(exc).__name__}: {exc}"
            if diff is not None:
                summary.outcomes[kind]["silent"] += 1
                fail("silent", index, f"{c.description}: {diff}", c.data, kind)
            elif c.rehashed:
                summary.outcomes[kind]["accepted_exact"] += 1
            else:
                summary.outcomes[kind]["accepted_identical"] += 1
                if strict:
                    fail("undetected", index, f"{c.description}: decoded (to the original)", c.data, kind)
    summary.seconds = time.perf_counter() - t0
    return summary


def format_summary(s: Summary) -> str:
    """The tables: outcomes per corruption kind, SyncError kinds per corruption kind, failures."""
    noops = f"; no-op edits drawn again: {sum(s.redrawn.values())}" if s.redrawn else ""
    if s.no_op:
        noops += f", left out as no-ops: {sum(s.no_op.values())}"
    lines = [f"messages: {s.messages} ({s.valid_ok} round-tripped exactly), corrupted messages: {s.corrupted}"
             f"{noops}, {s.seconds:.1f} s" + (" (stopped at --max-seconds)" if s.stopped_early else "")]
    kinds = [k for k in KINDS if k in s.outcomes]
    w = max([len("corruption"), *map(len, kinds)])
    cols = [*OUTCOMES, "wrong_kind"]
    lines.append(f"{'corruption':<{w}}  {'total':>6}  " + "  ".join(f"{c:>{max(len(c), 6)}}" for c in cols))
    for k in kinds:
        row = [s.outcomes[k][c] for c in OUTCOMES] + [s.wrong_kind[k]]
        lines.append(f"{k:<{w}}  {sum(s.outcomes[k].values()):>6}  "
                     + "  ".join(f"{v:>{max(len(c), 6)}}" for c, v in zip(cols, row)))
    err_kinds = sorted({e for c in s.error_kinds.values() for e in c})
    if err_kinds:
        lines.append("")
        lines.append(f"{'SyncError kind':<{w}}  " + "  ".join(f"{e:>{max(len(e), 6)}}" for e in err_kinds))
        for k in kinds:
            lines.append(f"{k:<{w}}  " + "  ".join(f"{s.error_kinds[k][e]:>{max(len(e), 6)}}" for e in err_kinds))
        totals = Counter()
        for c in s.error_kinds.values():
            totals.update(c)
        lines.append(f"{'(all)':<{w}}  " + "  ".join(f"{totals[e]:>{max(len(e), 6)}}" for e in err_kinds))
    lines.append("")
    if s.failed:
        lines.append(f"FAILED: {s.failed} ({', '.join(f'{k} {v}' for k, v in sorted(s.failure_counts.items()))})")
        lines += s.failures
    else:
        lines.append("OK: every valid message round-tripped; every corruption was rejected or decoded to exactly "
                     "the re-hashed message it was")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20000, help="random valid deltas (default 20000)")
    parser.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    parser.add_argument("--start", type=int, default=0,
                        help="index of the first message (replays one with --messages 1)")
    parser.add_argument("--corruptions", type=int, default=3, help="corruptions per message (default 3)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated corruption kinds (default all: {','.join(KINDS)})")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop generating messages after this long (at least one message runs)")
    parser.add_argument("--lenient", action="store_true",
                        help="a corruption that decodes to the original message is not a failure")
    parser.add_argument("--dump", type=Path, default=None,
                        help="directory to write each failing message's bytes to (created on the first failure)")
    args = parser.parse_args(argv)
    if args.messages < 1:  # zero messages would report OK having checked nothing
        parser.error(f"argument --messages: {args.messages} must be >= 1")
    if args.corruptions < 0:
        parser.error(f"argument --corruptions: {args.corruptions} must be >= 0")
    if args.max_seconds is not None and not 0 < args.max_seconds < float("inf"):
        parser.error(f"argument --max-seconds: {args.max_seconds} must be a positive number of seconds")
    if args.dump is not None:  # checked now: a failure's bytes must not be lost to an unwritable --dump
        from megatron_logra.bench.outputs import why_unwritable
        problem = why_unwritable(args.dump, directory=True)
        if problem:
            parser.error(f"argument --dump: {problem}; give a directory (created on the first failure)")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"unknown corruption kinds {unknown}; choose from {','.join(KINDS)}")
    summary = run(args.messages, args.seed, start=args.start, corruptions=args.corruptions, kinds=kinds,
                  max_seconds=args.max_seconds, strict=not args.lenient, dump=args.dump)
    print(format_summary(summary))
    return summary.exit_code()


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors: extra intra-op threads only add overhead
    sys.exit(main())

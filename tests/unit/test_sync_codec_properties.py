"""Property-based tests of the sketch-delta wire format (:mod:`megatron_logra.sync.codec`).

Messages are random :class:`SketchDelta` s: 0-20 targets under canonical names with the
layout their name implies (several layers, fused QKV with consistent attention dims, an even
``[gate; up]``, row-parallel and plain targets), any rank, bf16 factors both on
``quantize_factor``'s exact-sum grid and as arbitrary bit patterns (NaN, inf, subnormals,
-0: the codec carries bits and does not require the grid; ``apply.validate`` does), dense
tensors of every allowed dtype and any 0-3 dim shape (scalars and empty tensors included), large
versions and seeds, and any decay in (0, 1].

Properties (every generated message counts towards the >= 1,000 checked by the last test):

* round trip: ``decode(encode(d))`` equals ``d`` field by field and bit for bit, re-encodes
  to the same bytes, and its checksum is the documented sha256;
* a single flipped byte is rejected with :class:`SyncError` (the header's spelling counts:
  a re-spelled but equivalent JSON header is a corruption too);
* any proper prefix is ``truncated``; any appended bytes are ``malformed``;
* several flipped bytes (unless they cancel out), or a header edit without a recomputed
  checksum, raise ``SyncError``; nothing that decodes differs from the original;
* a well-typed header edit *with* a recomputed checksum decodes to exactly the edited
  message or raises ``SyncError``; an ill-typed one (another JSON type, a removed key)
  raises ``SyncError`` and never another exception.

Defects these properties found (exceptions other than ``SyncError`` from ill-typed headers,
lax acceptance of unknown keys and duplicates, 0-d tensors that could not be hashed) are kept
as reproducers at the end.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from megatron_logra.sketch.naming import canonical_name
from megatron_logra.sketch.random_projection import DISTRIBUTIONS
from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor, decode, encode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import quantize_factor
from megatron_logra.sync.schema import DENSE_DTYPES, LAYOUTS, MAGIC, expected_layout
from tool_modules import load_tool


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# The wire-level reference (documented checksum, raw pack / unpack, bitwise tensor equality) is the
# fuzz tool's, written from the format's description and independent of the codec under test.
_wire = load_tool("fuzz_sync_codec")
reference_digest, unpack, pack = _wire.reference_digest, _wire.unpack, _wire.pack
_same_tensor, _canonical_json = _wire._same_tensor, _wire.canonical_json


_LAYER_SUFFIXES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                   "mlp.router", "self_attn.q_norm")
_GLOBAL_TARGETS = ("lm_head", "model.embed_tokens")
_DENSE_NAMES = ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight",
                "model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.q_proj.bias",
                "model.layers.3.self_attn.k_proj.bias", "model.layers.1.mlp.down_proj.bias")
_VALUE_KINDS = ("grid", "bits", "zeros", "special")
_SPECIAL = (0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), float("nan"), 1e-40, 3e38, 2.0**-126)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

CODEC_PROPERTIES = ("round_trip", "single_byte_flip", "truncation", "extension", "multi_byte_flip",
                    "header_edit_without_checksum", "header_edit_with_checksum")
"""The properties whose generated messages count towards the total."""
MIN_MESSAGES = 1000
_MESSAGES: Counter = Counter()
"""Messages generated per property in this session."""

_FAST = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- strategies


def _values(shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` filled per ``kind`` from a ``torch.Generator`` seeded by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "bits":  # every bit pattern: NaN payloads, infinities, subnormals, -0
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(-(2 ** (8 * size - 1)), 2 ** (8 * size - 1), shape, dtype=torch.int64, generator=gen)
        return raw.to(_INT_OF_SIZE[size]).view(dtype)
    if kind == "special":
        idx = torch.randint(0, len(_SPECIAL), shape, generator=gen)
        return torch.tensor(_SPECIAL, dtype=torch.float64)[idx].to(dtype)
    scale = 10.0 ** float(torch.randint(-30, 5, (), generator=gen))
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if kind == "grid" and dtype == torch.bfloat16 and len(shape) == 2 and shape[1] >= 1:
        return quantize_factor(x.float())
    return x.to(dtype)


@st.composite
def attention_dims(draw: st.DrawFn) -> AttentionDims:
    """``H = G·(H/G)`` query heads over ``G`` groups, head dim ``d`` (tiny)."""
    groups = draw(st.integers(1, 4))
    return AttentionDims(groups * draw(st.integers(1, 3)), groups, draw(st.integers(1, 4)))


@st.composite
def target_factors(draw: st.DrawFn, name: str, rank: int, attention: Optional[AttentionDims]) -> TargetFactor:
    """One target under canonical ``name``: rows its layout allows, bf16 ``[n_out, rank]``."""
    layout = expected_layout(name)
    if layout == "qkv_interleaved":
        assert attention is not None
        n_out = attention.qkv_rows
    elif layout == "gate_up":
        n_out = 2 * draw(st.integers(1, 8))
    else:
        n_out = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(_VALUE_KINDS))
    U_OR = _values((n_out, rank), torch.bfloat16, kind, draw(st.integers(0, 2**32 - 1)))
    return TargetFactor(name=name, U_OR=U_OR, n_in=draw(st.integers(1, 1 << 16)), layout=layout)


@st.composite
def dense_tensors(draw: st.DrawFn) -> torch.Tensor:
    """A dense tensor of an allowed dtype and any small shape of 0-3 dims (scalars and empty ones included)."""
    dtype = DENSE_DTYPES[draw(st.sampled_from(sorted(DENSE_DTYPES)))]
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    return _values(shape, dtype, draw(st.sampled_from(_VALUE_KINDS)), draw(st.integers(0, 2**32 - 1)))


_dense_names = st.one_of(st.sampled_from(_DENSE_NAMES), st.text(min_size=1, max_size=12))


@st.composite
def sketch_deltas(draw: st.DrawFn) -> SketchDelta:
    """A valid random delta (``check_structure`` passes; ``encode`` accepts it)."""
    rank = draw(st.integers(1, 6))
    names: list[str] = []
    for layer in draw(st.lists(st.integers(0, 99), unique=True, max_size=3)):
        suffixes = draw(st.lists(st.sampled_from(_LAYER_SUFFIXES), unique=True))
        names += [f"model.layers.{layer}.{s}" for s in suffixes]
    names += draw(st.lists(st.sampled_from(_GLOBAL_TARGETS), unique=True))
    names = list(draw(st.permutations(names)))
    assert all(canonical_name(n) == n for n in names)
    needs_attention = any(expected_layout(n) == "qkv_interleaved" for n in names)
    attention = draw(attention_dims()) if needs_attention or draw(st.booleans()) else None
    base = draw(st.integers(0, 2**40))
    delta = SketchDelta(
        base_version=base,
        new_version=base + draw(st.integers(1, 2**40)),
        seed=draw(st.integers(0, 2**64 - 1)),
        update_index=draw(st.integers(0, 2**31)), step=draw(st.integers(0, 2**40)),
        rank=rank,
        distribution=draw(st.sampled_from(DISTRIBUTIONS)),
        targets=[draw(target_factors(n, rank, attention)) for n in names],
        dense=draw(st.dictionaries(_dense_names, dense_tensors(), max_size=3)),
        decay=draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True))),
        rounding=draw(st.sampled_from(("nearest", "stochastic"))),
        attention=attention,
        chain=draw(st.one_of(st.none(), st.text("0123456789abcdef", min_size=32, max_size=32))),
    )
    delta.check_structure()
    return delta


# --------------------------------------------------------------------------- helpers


def assert_same_delta(got: SketchDelta, want: SketchDelta) -> None:
    """``got`` equals ``want`` in every header field, type included, and bit for bit in every tensor."""
    for f in ("base_version", "new_version", "seed", "update_index", "step", "rank", "distribution", "decay", "rounding",
              "attention", "format_version"):
        a, b = getattr(got, f), getattr(want, f)
        assert type(a) is type(b) and a == b, f
    assert [(t.name, t.n_in, t.layout) for t in got.targets] == [(t.name, t.n_in, t.layout) for t in want.targets]
    for a, b in zip(got.targets, want.targets):
        assert _same_tensor(a.U_OR, b.U_OR), a.name
    assert sorted(got.dense) == sorted(want.dense)
    for k in want.dense:
        assert _same_tensor(got.dense[k], want.dense[k]), k


def _st_header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def _reject_or_original(data: bytes, original: SketchDelta) -> Optional[SyncError]:
    """Decode corrupted ``data``: return the SyncError, or check the result is ``original`` (None)."""
    try:
        got = decode(data)
    except SyncError as exc:
        return exc
    assert_same_delta(got, original)
    return None


def _count(prop: str) -> None:
    _MESSAGES[prop] += 1


# --------------------------------------------------------------------------- round trip


@settings(max_examples=200, **_FAST)
@given(delta=sketch_deltas())
def test_round_trip_is_exact(delta: SketchDelta) -> None:
    """``decode(encode(d))`` equals ``d`` (fields with their types, tensors bit for bit),
    ``encode`` of it gives the same bytes, and the checksum is the documented sha256."""
    _count("round_trip")
    data = encode(delta)
    got = decode(data)
    assert_same_delta(got, delta)
    assert got.checksum == delta.checksum
    header, tensors = unpack(data)
    assert header == delta.header()
    assert got.checksum == reference_digest(header, tensors)
    assert encode(got) == data


# --------------------------------------------------------------------------- corruptions


@settings(max_examples=300, **_FAST)
@given(delta=sketch_deltas(), data=st.data())
def test_a_single_flipped_byte_is_rejected(delta: SketchDelta, data: st.DataObject) -> None:
    """Flipping any one byte with any non-zero xor mask raises ``SyncError``: the length prefix,
    the safetensors JSON header (its spelling included: padding, whitespace, number formats)
    and every tensor byte are covered."""
    _count("single_byte_flip")
    good = encode(delta)
    n = _st_header_len(good)
    pos = data.draw(st.one_of(st.integers(0, len(good) - 1),  # anywhere, or in the JSON header's tail (padding)
                              st.integers(max(8, 8 + n - 16), 8 + n - 1)), label="position")
    mask = data.draw(st.one_of(st.integers(1, 255), st.sampled_from([0x01, 0x20, 0x29, 0x2A, 0x2D, 0x4B, 0x80])),
                     label="xor mask")
    bad = bytearray(good)
    bad[pos] ^= mask
    with pytest.raises(SyncError):
        decode(bytes(bad))


@settings(max_examples=150, **_FAST)
@given(delta=sketch_deltas(), data=st.data())
def test_every_proper_prefix_is_truncated(delta: SketchDelta, data: st.DataObject) -> None:
    """Any prefix shorter than the message (the empty one included) raises ``SyncError("truncated")``."""
    _count("truncation")
    good = encode(delta)
    cut = data.draw(st.one_of(st.integers(0, len(good) - 1), st.integers(max(0, len(good) - 9), len(good) - 1)),
                    label="cut")
    with pytest.raises(SyncError) as exc:
        decode(good[:cut])
    assert exc.value.kind == "truncated"


@settings(max_examples=100, **_FAST)
@given(delta=sketch_deltas(), extra=st.binary(min_size=1, max_size=64))
def test_appended_bytes_are_malformed(delta: SketchDelta, extra: bytes) -> None:
    """Any non-empty suffix appended to a valid message raises ``SyncError("malformed")``."""
    _count("extension")
    with pytest.raises(SyncError) as exc:
        decode(encode(delta) + extra)
    assert exc.value.kind == "malformed"


@settings(max_examples=150, **_FAST)
@given(delta=sketch_deltas(), data=st.data())
def test_several_flipped_bytes_never_pass_silently(delta: SketchDelta, data: st.DataObject) -> None:
    """Flipping 2-16 bytes anywhere raises ``SyncError`` unless the flips cancel out (then the
    message decodes to exactly the original)."""
    _count("multi_byte_flip")
    good = encode(delta)
    bad = bytearray(good)
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)), min_size=2, max_size=16),
                      label="flips")
    for pos, mask in flips:
        bad[pos] ^= mask
    error = _reject_or_original(bytes(bad), delta)
    assert error is not None or bytes(bad) == good


# Header edits: (path into the header, new value). Paths are keys / list indices.
_Path = tuple[Any, ...]


def _header_paths(header: dict) -> list[_Path]:
    """Every editable leaf and container of a delta header."""
    paths: list[_Path] = [(k,) for k in header]
    for i, t in enumerate(header["targets"]):
        paths += [("targets", i, k) for k in t]
    for i, d in enumerate(header["dense"]):
        paths += [("dense", i, k) for k in d]
    if header["attention"] is not None:
        paths += [("attention", k) for k in header["attention"]]
    return paths


def _set(header: dict, path: _Path, value: Any) -> None:
    node = header
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _get(header: dict, path: _Path) -> Any:
    node = header
    for key in path:
        node = node[key]
    return node


def _well_typed_values(old: Any) -> st.SearchStrategy:
    """Replacement values of the same JSON type as ``old`` (strings, ints, floats, int lists, attention dicts)."""
    if isinstance(old, bool):
        return st.booleans()
    if isinstance(old, int):
        return st.one_of(st.integers(-2, 2**64), st.sampled_from([old - 1, old + 1, 0, -1]))
    if isinstance(old, float):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(old, str):
        names = [MAGIC, "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
                 "model.layers.0.self_attn.q_proj", "lm_head"]
        return st.one_of(st.sampled_from([*LAYOUTS, *DISTRIBUTIONS, *sorted(DENSE_DTYPES), *names]), st.text(max_size=8))
    if isinstance(old, list) and all(isinstance(x, int) for x in old):
        return st.lists(st.integers(-1, 6), max_size=3)
    if old is None or isinstance(old, dict):
        dims = st.fixed_dictionaries({k: st.integers(0, 4) for k in ("num_heads", "num_kv_heads", "head_dim")})
        return st.one_of(st.none(), dims)
    return st.just(old)


def _sorted_dense(header: dict) -> dict:
    out = dict(header)
    out["dense"] = sorted(header["dense"], key=lambda d: d["name"])
    return out


@settings(max_examples=100, **_FAST)
@given(delta=sketch_deltas(), data=st.data())
def test_a_header_edit_without_its_checksum_is_rejected(delta: SketchDelta, data: st.DataObject) -> None:
    """Changing any header value (same JSON type) but keeping the old sha256 raises ``SyncError``."""
    _count("header_edit_without_checksum")
    good = encode(delta)
    header, tensors = unpack(good)
    path = data.draw(st.sampled_from(_header_paths(header)), label="path")
    new = data.draw(_well_typed_values(_get(header, path)), label="value")
    _set(header, path, new)
    error = _reject_or_original(pack(header, tensors, delta.checksum), delta)
    if error is None:  # only an edit that changes nothing may pass
        assert _canonical_json(header) == _canonical_json(delta.header())


@settings(max_examples=100, **_FAST)
@given(delta=sketch_deltas(), data=st.data())
def test_a_rehashed_header_edit_decodes_exactly_or_is_rejected(delta: SketchDelta, data: st.DataObject) -> None:
    """A header edit of the same JSON type *with* a recomputed checksum (a well-formed message
    from a buggy writer) raises ``SyncError`` or decodes to exactly that header and tensors."""
    _count("header_edit_with_checksum")
    header, tensors = unpack(encode(delta))
    path = data.draw(st.sampled_from(_header_paths(header)), label="path")
    _set(header, path, data.draw(_well_typed_values(_get(header, path)), label="value"))
    try:
        got = decode(pack(header, tensors, reference_digest(header, tensors)))
    except SyncError:
        return
    assert _canonical_json(got.header()) == _canonical_json(_sorted_dense(header))
    for t in got.targets:
        assert _same_tensor(t.U_OR, tensors[f"U/{t.name}"])
    for k, v in got.dense.items():
        assert _same_tensor(v, tensors[f"dense/{k}"])


_ILL_TYPED = st.sampled_from([None, True, "x", [], {}, 1.5, [1], {"name": 1}])


@settings(max_examples=60, phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False, **_FAST)
@given(delta=sketch_deltas(), data=st.data())
def test_a_rehashed_ill_typed_header_is_a_sync_error(delta: SketchDelta, data: st.DataObject) -> None:
    """Any header value replaced by one of another JSON type, or removed, with a recomputed
    checksum, raises ``SyncError`` (never another exception) or decodes to exactly that header."""
    header, tensors = unpack(encode(delta))
    path = data.draw(st.sampled_from(_header_paths(header)), label="path")
    if data.draw(st.booleans(), label="remove"):
        del _get(header, path[:-1])[path[-1]]
    else:
        _set(header, path, data.draw(_ILL_TYPED, label="value"))
    try:
        got = decode(pack(header, tensors, reference_digest(header, tensors)))
    except SyncError:
        return
    assert _canonical_json(got.header()) == _canonical_json(_sorted_dense(header))


# --------------------------------------------------------------------------- regressions


def _small_delta() -> SketchDelta:
    gen = torch.Generator().manual_seed(0)
    U = quantize_factor(torch.randn(4, 2, generator=gen) * 1e-2)
    return SketchDelta(base_version=0, new_version=1, seed=5, update_index=0, rank=2, distribution="rademacher",
                       targets=[TargetFactor("model.layers.0.mlp.gate_up_proj", U, 8, "gate_up")],
                       dense={"model.norm.weight": torch.ones(3)}, decay=1.0)


def _flip_padding_to_tab(data: bytes) -> bytes:
    end = 8 + _st_header_len(data)
    assert data[end - 1 : end] == b" ", "safetensors pads its JSON header with spaces"
    return data[: end - 1] + b"\t" + data[end:]


def _respell_decay(data: bytes) -> bytes:
    old = b'\\"decay\\":1.0'
    i = data.index(old)
    return data[:i] + b'\\"decay\\":1e0' + data[i + len(old):]


@pytest.mark.parametrize("respell", [_flip_padding_to_tab, _respell_decay])
def test_a_respelled_header_is_rejected(respell: Callable[[bytes], bytes]) -> None:
    """Byte changes that keep the JSON's meaning (a padding space turned into a tab, ``1.0``
    spelled ``1e0`` inside the delta metadata) are still corruptions: ``SyncError``."""
    data = encode(_small_delta())
    bad = respell(data)
    assert bad != data and len(bad) == len(data)
    with pytest.raises(SyncError):
        decode(bad)


def _rehashed(edit: Callable[[dict], None]) -> Callable[[], SketchDelta]:
    """Decode of a message whose header ``edit`` changed, with a recomputed (valid) checksum."""
    def run() -> SketchDelta:
        header, tensors = unpack(encode(_small_delta()))
        edit(header)
        return decode(pack(header, tensors, reference_digest(header, tensors)))
    return run


def _scalar_tensor_message() -> SketchDelta:
    """Decode of a message holding a 0-d tensor (the checksum need not even be right)."""
    header, tensors = unpack(encode(_small_delta()))
    header["dense"].append({"name": "scale", "dtype": "float32", "shape": []})
    tensors["dense/scale"] = torch.tensor(2.0)
    return decode(pack(header, tensors, "0" * 64))


def _encode_scalar_dense() -> bytes:
    delta = _small_delta()
    delta.dense["scale"] = torch.tensor(2.0)
    return encode(delta)


# Checksummed headers of the wrong JSON shape once escaped as AttributeError / KeyError / TypeError,
# and 0-d tensors could not be hashed (RuntimeError): each must now be a SyncError.
_REGRESSIONS: dict[str, Callable[[], object]] = {
    "targets_not_objects": _rehashed(lambda h: h.update(targets=[1])),
    "attention_not_an_object": _rehashed(lambda h: h.update(attention="x")),
    "dense_list_missing": _rehashed(lambda h: h.pop("dense")),
    "dense_entry_without_name": _rehashed(lambda h: h["dense"][0].pop("name")),
    "dense_dtype_unhashable": _rehashed(lambda h: h["dense"][0].update(dtype=["x"])),
    "targets_null": _rehashed(lambda h: h.update(targets=None)),
    "targets_as_object": _rehashed(lambda h: h.update(targets={})),
    "unknown_header_key": _rehashed(lambda h: h.update(comment="dropped by a lax reader")),
    "duplicate_target": _rehashed(lambda h: h["targets"].append(dict(h["targets"][0]))),
    "duplicate_dense": _rehashed(lambda h: h["dense"].append(dict(h["dense"][0]))),
    "format_version_true": _rehashed(lambda h: h.update(format_version=True)),
    "scalar_tensor_with_a_wrong_checksum": _scalar_tensor_message,
}


@pytest.mark.parametrize("name", sorted(_REGRESSIONS))
def test_malformed_headers_are_sync_errors(name: str) -> None:
    """Each reproducer ends in ``SyncError``, never in another exception or a lax decode."""
    with pytest.raises(SyncError):
        _REGRESSIONS[name]()


def test_a_scalar_dense_tensor_round_trips() -> None:
    delta = _small_delta()
    delta.dense["scale"] = torch.tensor(2.0)
    got = decode(_encode_scalar_dense())
    assert got.dense["scale"].shape == () and torch.equal(got.dense["scale"], delta.dense["scale"])


# --------------------------------------------------------------------------- message count


def test_zz_at_least_a_thousand_messages_were_generated() -> None:
    """When every counted property ran in this session, together they generated >= 1,000 messages."""
    if set(_MESSAGES) != set(CODEC_PROPERTIES):
        pytest.skip(f"only {sorted(_MESSAGES)} of the codec properties ran")
    assert sum(_MESSAGES.values()) >= MIN_MESSAGES, dict(_MESSAGES)

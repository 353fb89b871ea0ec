"""Sketch-delta wire format (DESIGN §1 "Sketch-delta policy sync"): round trip and every rejection.

Malformed-but-consistent messages (extra key, wrong dtype, wrong shape with a valid checksum)
are crafted here by re-packing the safetensors blob and recomputing the digest with the codec's
own hash, so the test reaches the check behind the checksum.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from megatron_logra.sync import codec
from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor, decode, encode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.schema import FORMAT_VERSION
from megatron_logra.sync.synthetic import DenseShape, random_delta

SHAPE = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=40)


def _delta(**kw) -> SketchDelta:
    dense = {"model.norm.weight": torch.randn(32), "model.layers.0.input_layernorm.weight": torch.randn(32).bfloat16()}
    return random_delta(SHAPE, 8, base_version=3, new_version=4, seed=11, update_index=3, dense=dense, **kw)


def _metadata(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["logra.delta"])


def _repack(data: bytes, edit_header=None, edit_tensors=None, rehash: bool = True) -> bytes:
    meta = _metadata(data)
    tensors = st_load(data)
    header = meta["header"]
    if edit_header:
        edit_header(header)
    if edit_tensors:
        edit_tensors(tensors)
    digest = codec._digest(json.dumps(header, sort_keys=True, separators=(",", ":")), tensors) if rehash else meta["sha256"]
    outer = json.dumps({"header": header, "sha256": digest}, sort_keys=True, separators=(",", ":"))
    return st_save(tensors, metadata={"logra.delta": outer})


def test_round_trip_is_bitwise_and_carries_every_field():
    delta = _delta(distribution="gaussian")
    delta.decay = 0.999
    data = encode(delta)
    out = decode(data)
    assert out.checksum == delta.checksum and len(out.checksum) == 64
    for field in ("base_version", "new_version", "seed", "update_index", "step", "rank", "distribution", "decay", "rounding",
                  "attention", "format_version"):
        assert getattr(out, field) == getattr(delta, field), field
    assert [t.name for t in out.targets] == [t.name for t in delta.targets]
    for a, b in zip(out.targets, delta.targets):
        assert a.U_OR.dtype == torch.bfloat16 and torch.equal(a.U_OR.view(torch.int16), b.U_OR.view(torch.int16))
        assert (a.n_in, a.layout) == (b.n_in, b.layout)
    assert set(out.dense) == set(delta.dense)
    for k in delta.dense:
        assert out.dense[k].dtype == delta.dense[k].dtype and torch.equal(out.dense[k], delta.dense[k])
    assert encode(out) == data  # deterministic bytes
    assert len(data) - delta.payload_bytes() < 8192  # header overhead is small


def test_flipped_byte_in_tensor_data_is_a_checksum_error():
    data = bytearray(encode(_delta()))
    data[-5] ^= 0x01  # inside the last tensor's bytes
    with pytest.raises(SyncError, match="sha256 mismatch") as exc:
        decode(bytes(data))
    assert exc.value.kind == "checksum"


def test_any_single_byte_flip_is_rejected():
    data = encode(_delta())
    for pos in range(0, len(data), max(1, len(data) // 97)):
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(SyncError):
            decode(bytes(bad))


def test_equivalent_spellings_of_the_headers_are_rejected():
    """The sha256 covers the headers' content; bytes that spell the same content differently
    (whitespace in the safetensors padding, ``1.0`` as ``1e0``) must not pass either."""
    for step in (10**k for k in range(9)):  # one more digit each: some header length is not a multiple of 8
        data = encode(_delta(step=step))
        (n,) = struct.unpack("<Q", data[:8])
        padding = len(data[8 : 8 + n]) - len(data[8 : 8 + n].rstrip(b" "))
        if padding:
            break
    assert padding > 0, "no message with header padding to probe"
    for ws in b"\t\n\r":
        bad = bytearray(data)
        bad[8 + n - 1] = ws
        with pytest.raises(SyncError, match="not in canonical form") as exc:
            decode(bytes(bad))
        assert exc.value.kind == "malformed"
    spelled = data.replace(b'\\"decay\\":1.0', b'\\"decay\\":1e0', 1)
    assert spelled != data and len(spelled) == len(data)
    with pytest.raises(SyncError, match="metadata is not in canonical form"):
        decode(spelled)


def test_every_whitespace_or_exponent_flip_in_the_headers_is_rejected():
    """Exhaustive over the header bytes for the masks that turn a space into whitespace or a
    ``.`` / digit into an exponent marker (the flips a content-only checksum would miss)."""
    data = encode(_delta())
    (n,) = struct.unpack("<Q", data[:8])
    for pos in range(8 + n):
        for mask in (0x29, 0x2A, 0x2D, 0x4B, 0x6B):
            bad = bytearray(data)
            bad[pos] ^= mask
            with pytest.raises(SyncError):
                decode(bytes(bad))


@pytest.mark.parametrize("cut", [0, 5, 8, 100, -1, -300])
def test_truncated_bytes_are_rejected(cut):
    data = encode(_delta())
    with pytest.raises(SyncError) as exc:
        decode(data[:cut])
    assert exc.value.kind == "truncated"


def test_trailing_garbage_is_rejected():
    with pytest.raises(SyncError, match="trailing") as exc:
        decode(encode(_delta()) + b"\0")
    assert exc.value.kind == "malformed"


def _with_safetensors_header(data: bytes, edit) -> bytes:
    """``data`` with its safetensors JSON header bytes replaced by ``edit(header bytes)``, same length."""
    (n,) = struct.unpack("<Q", data[:8])
    new = edit(bytearray(data[8 : 8 + n]))
    assert len(new) == n
    return data[:8] + bytes(new) + data[8 + n :]


def _break_json(h: bytearray) -> bytearray:
    h[0:1] = b"["  # '{' -> '[': the header no longer parses
    return h


def _not_an_object(h: bytearray) -> bytearray:
    return bytearray(b"[]" + b" " * (len(h) - 2))


def _bad_offsets(h: bytearray) -> bytearray:
    i = h.index(b'"data_offsets"')
    h[i : i + 14] = b'"data_offsetZ"'
    return h


@pytest.mark.parametrize("edit, message", [
    (_break_json, "not valid JSON"),
    (_not_an_object, "not a JSON object"),
    (_bad_offsets, "entry is malformed"),
])
def test_a_corrupt_header_of_full_length_is_malformed_not_truncated(edit, message):
    data = _with_safetensors_header(encode(_delta()), edit)
    with pytest.raises(SyncError, match=message) as exc:
        decode(data)
    assert exc.value.kind == "malformed"


def test_a_non_bytes_message_is_malformed():
    with pytest.raises(SyncError, match="expected bytes, got str") as exc:
        decode("not bytes")
    assert exc.value.kind == "malformed"


def test_unknown_format_version_is_named():
    data = _repack(encode(_delta()), edit_header=lambda h: h.update(format_version=FORMAT_VERSION + 1), rehash=False)
    with pytest.raises(SyncError, match=f"unknown format version {FORMAT_VERSION + 1}") as exc:
        decode(data)
    assert exc.value.kind == "format_version"


def test_extra_and_missing_tensor_keys_are_named():
    extra = _repack(encode(_delta()), edit_tensors=lambda t: t.update({"dense/intruder": torch.zeros(3)}))
    with pytest.raises(SyncError, match=r"extra \['dense/intruder'\]"):
        decode(extra)
    name = "U/model.layers.1.mlp.down_proj"
    missing = _repack(encode(_delta()), edit_tensors=lambda t: t.pop(name))
    with pytest.raises(SyncError, match=r"missing \['U/model.layers.1.mlp.down_proj'\]") as exc:
        decode(missing)
    assert exc.value.kind == "keys"


def test_wrong_dtype_and_shape_with_a_valid_checksum_are_named():
    name = "U/model.layers.0.self_attn.o_proj"
    wrong_dtype = _repack(encode(_delta()), edit_tensors=lambda t: t.update({name: t[name].float()}))
    with pytest.raises(SyncError, match="o_proj is torch.float32, expected torch.bfloat16") as exc:
        decode(wrong_dtype)
    assert exc.value.kind == "dtype"
    wrong_shape = _repack(encode(_delta()), edit_tensors=lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(SyncError, match="o_proj has shape") as exc:
        decode(wrong_shape)
    assert exc.value.kind == "shape"
    dense_shape = _repack(encode(_delta()), edit_tensors=lambda t: t.update({"dense/model.norm.weight": torch.zeros(31)}))
    with pytest.raises(SyncError, match="dense model.norm.weight"):
        decode(dense_shape)


def test_header_semantics_are_checked():
    def rename(h):
        h["targets"][0]["name"] = "decoder.layers.0.self_attention.linear_qkv"

    with pytest.raises(SyncError, match="not canonical"):
        decode(_repack(encode(_delta()), edit_header=rename))

    def relayout(h):
        h["targets"][1]["layout"] = "gate_up"

    with pytest.raises(SyncError, match="expected 'row_parallel'") as exc:
        decode(_repack(encode(_delta()), edit_header=relayout))
    assert exc.value.kind == "layout"
    with pytest.raises(SyncError, match="new_version=3 must be > base_version=3"):
        decode(_repack(encode(_delta()), edit_header=lambda h: h.update(new_version=3)))


def test_encode_refuses_malformed_deltas():
    delta = _delta()
    delta.targets[0].U_OR = delta.targets[0].U_OR.float()
    with pytest.raises(SyncError, match="expected torch.bfloat16"):
        encode(delta)
    qkv = TargetFactor("model.layers.0.self_attn.qkv_proj", torch.zeros(10, 8, dtype=torch.bfloat16), 32, "qkv_interleaved")
    bad = SketchDelta(0, 1, 0, 0, 8, "rademacher", [qkv], attention=AttentionDims(4, 2, 8))
    with pytest.raises(SyncError, match="has 10 rows, attention dims"):
        encode(bad)
    bad.attention = None
    with pytest.raises(SyncError, match="needs attention dims"):
        encode(bad)


def test_tampered_header_without_rehash_is_a_checksum_error():
    data = _repack(encode(_delta()), edit_header=lambda h: h.update(new_version=9), rehash=False)
    with pytest.raises(SyncError, match="sha256 mismatch"):
        decode(data)


def test_pathological_json_is_a_sync_error_not_a_crash():
    """An int past Python's 4300-digit limit or 100,000 levels of nesting in the metadata, and such
    an int as a layer index under a valid checksum: ``SyncError``, never ValueError / RecursionError."""
    data = encode(_delta())
    tensors = st_load(data)
    meta = _metadata(data)
    big = "9" * 5000
    spelled = json.dumps(meta, sort_keys=True, separators=(",", ":")).replace('"seed":', f'"seed":{big},"x":', 1)
    deep = "[" * 100_000 + "]" * 100_000
    for raw in (spelled, deep):
        with pytest.raises(SyncError) as exc:
            decode(st_save(tensors, metadata={"logra.delta": raw}))
        assert exc.value.kind == "checksum"

    def big_layer(h):
        h["targets"][0]["name"] = h["targets"][0]["name"].replace(".0.", f".{big}.", 1)

    with pytest.raises(SyncError) as exc:
        decode(_repack(data, edit_header=big_layer))
    assert exc.value.kind == "name"


def test_the_checksum_covers_content_not_the_containers_layout():
    """As the module docstring says: the sha256 covers the header, names, dtypes, shapes and tensor data, not
    the order of the safetensors tensor-info entries. Reordering them (same offsets, canonical spelling) gives
    other bytes that decode to the same delta; changing one content byte is still refused."""
    delta = _delta()
    data = encode(delta)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    keys = [k for k in header if k != "__metadata__"]
    reordered = {"__metadata__": header["__metadata__"], **{k: header[k] for k in reversed(keys)}}
    packed = json.dumps(reordered, separators=(",", ":"), ensure_ascii=False).encode()
    packed += b" " * (-len(packed) % 8)
    other = struct.pack("<Q", len(packed)) + packed + data[8 + n :]
    assert other != data
    out = decode(other)
    assert out.checksum == delta.checksum and encode(out) == data
    flipped = bytearray(data)
    flipped[-1] ^= 1  # the last byte of the tensor data
    with pytest.raises(SyncError) as exc:
        decode(bytes(flipped))
    assert exc.value.kind == "checksum"

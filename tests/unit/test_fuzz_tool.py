"""``tools/fuzz_sync_codec.py``: a short run passes on the codec and accounts for every message,
and a decoder that verifies nothing is caught (the real codec is never patched: the tool takes
the decode function as a parameter)."""

from __future__ import annotations

import json
import struct
from types import ModuleType

import pytest
from safetensors.torch import load as st_load

from megatron_logra.sync.codec import AttentionDims, SketchDelta, TargetFactor
from tool_modules import load_tool



@pytest.fixture(scope="module")
def fuzz(one_thread) -> ModuleType:
    """The tool, imported from its file."""
    return load_tool("fuzz_sync_codec")


def test_main_exits_zero_on_the_codec(fuzz: ModuleType, capsys: pytest.CaptureFixture) -> None:
    """``main --messages 200`` (every corruption kind) exits 0 and prints one row per kind."""
    kinds = fuzz.KINDS
    assert fuzz.main(["--messages", "200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("messages: 200 (200 round-tripped exactly), corrupted messages: 600")
    assert "OK: every valid message round-tripped" in out
    for kind in kinds:
        assert any(line.startswith(kind + " ") for line in out.splitlines()), kind


def test_summary_counts_add_up(fuzz: ModuleType) -> None:
    """Every corrupted message has exactly one outcome, kinds are taken in turn, every rejection
    has one SyncError kind, and truncations / extensions carry the required kind."""
    kinds = fuzz.KINDS
    s = fuzz.run(200, seed=3)
    assert s.messages == s.valid_ok == 200 and s.failed == 0 and not s.failures
    assert s.corrupted == 200 * 3
    per_kind = {k: sum(s.outcomes[k].values()) for k in kinds}
    assert set(per_kind) == set(kinds) and sum(per_kind.values()) == s.corrupted
    assert max(per_kind.values()) - min(per_kind.values()) <= 1
    for k in kinds:
        assert set(s.outcomes[k]) <= set(fuzz.OUTCOMES)
        assert sum(s.error_kinds[k].values()) == s.outcomes[k]["rejected"], k
        assert s.outcomes[k]["silent"] == s.outcomes[k]["crash"] == s.outcomes[k]["accepted_identical"] == 0, k
    assert set(s.error_kinds["truncate"]) == {"truncated"} and set(s.error_kinds["extend"]) == {"malformed"}
    for k in ("byte_flip", "multi_flip", "truncate", "extend", "garbage", "respell", "swap_tensors"):
        assert s.outcomes[k]["rejected"] == per_kind[k], k  # no re-hash: everything is rejected
    table = fuzz.format_summary(s)
    assert table.count("\n") >= 2 * len(kinds)


def lax_decode(data: bytes) -> SketchDelta:
    """Reads a message like ``decode`` but verifies nothing (no checksum, no structure checks)."""
    (n,) = struct.unpack("<Q", data[:8])
    outer = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["logra.delta"])
    h, tensors = outer["header"], st_load(data)
    att = h["attention"]
    return SketchDelta(
        base_version=h["base_version"], new_version=h["new_version"], seed=h["seed"], update_index=h["update_index"],
        step=h["step"], rank=h["rank"], distribution=h["distribution"],
        targets=[TargetFactor(t["name"], tensors[f"U/{t['name']}"], t["n_in"], t["layout"]) for t in h["targets"]],
        dense={d["name"]: tensors[f"dense/{d['name']}"] for d in h["dense"]}, decay=h["decay"],
        rounding=h["rounding"], attention=None if att is None else AttentionDims(**att), chain=h.get("chain"),
        format_version=h["format_version"], checksum=outer["sha256"],
    )


def test_a_decoder_that_verifies_nothing_fails_the_run(fuzz: ModuleType) -> None:
    """With ``lax_decode`` valid messages still round-trip, but flipped tensor bytes pass silently
    and unparseable bytes crash it: the run reports failures and exits 1."""
    s = fuzz.run(60, seed=0, decode_fn=lax_decode, kinds=("byte_flip", "truncate", "swap_tensors", "respell"))
    assert s.valid_ok == s.messages == 60
    assert s.exit_code() == 1 and s.failed > 0 and s.failures
    assert s.failure_counts["silent"] > 0 and s.failure_counts["crash"] > 0
    assert s.outcomes["swap_tensors"]["silent"] + s.outcomes["swap_tensors"]["accepted_identical"] > 0
    assert s.failure_counts["undetected"] + s.failure_counts["silent"] + s.failure_counts["crash"] == s.failed
    assert "FAILED" in fuzz.format_summary(s) and "replay: python tools/fuzz_sync_codec.py --seed 0" in s.failures[0]


def test_bad_arguments_are_refused(fuzz: ModuleType) -> None:
    with pytest.raises(SystemExit) as exc:
        fuzz.main(["--kinds", "byte_flip,nonsense"])
    assert exc.value.code == 2


@pytest.mark.parametrize("kind", ["header_edit_rehash_illtyped", "header_edit_rehash_extra"])
def test_rehashed_headers_of_the_wrong_shape_are_all_rejected(fuzz: ModuleType, kind: str) -> None:
    """Checksummed headers of another JSON type, with unknown keys or with entries listed twice
    (once AttributeError / KeyError / TypeError, or silently dropped) are each a SyncError."""
    s = fuzz.run(100, seed=0, kinds=(kind,))
    assert s.failed == 0, fuzz.format_summary(s)
    assert s.corrupted == 300 and s.outcomes[kind]["silent"] == s.outcomes[kind]["crash"] == 0
    assert s.outcomes[kind]["rejected"] == s.corrupted  # edits that changed nothing are drawn again

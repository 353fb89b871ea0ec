"""``tools/fuzz_sync_codec.py``: a drawn "corruption" that changes nothing (the same bytes, or the same
header and tensors) is drawn again and never counted, so the corruption counts are exact and the
"must raise" kinds show no acceptances."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from megatron_logra.sync.codec import encode
from tool_modules import load_tool


@pytest.fixture(scope="module")
def fuzz(one_thread) -> ModuleType:
    return load_tool("fuzz_sync_codec")


def test_header_edits_with_the_old_checksum_are_all_rejected(fuzz):
    """Seed 3 used to show ``header_edit`` rows as accepted_exact: edits such as "targets left empty" on an
    empty list or ``step`` set to its own value left the bytes as they were and were counted as corrupted."""
    s = fuzz.run(100, seed=3, kinds=("header_edit",))
    assert s.failed == 0, fuzz.format_summary(s)
    assert dict(s.outcomes["header_edit"]) == {"rejected": 300}
    assert s.corrupted == 300 and not s.no_op
    assert s.redrawn["header_edit"] > 0  # no-ops were drawn, and drawn again
    assert f"no-op edits drawn again: {s.redrawn['header_edit']}" in fuzz.format_summary(s).splitlines()[0]


def test_no_op_draws_are_recognised(fuzz):
    """``corrupt`` marks edits that leave header and tensors as they were (an empty list "left empty",
    dense entries reordered), whatever their bytes; real edits are not marked."""
    seen = {"same bytes": 0, "same meaning, other bytes": 0, "real": 0}
    for index in range(150):
        rng = random.Random(f"0/{index}")
        data = encode(fuzz.random_delta(rng))
        header0, tensors0 = fuzz.unpack(data)
        for kind in ("header_edit", "header_edit_rehash", "swap_tensors_rehash"):
            c = fuzz.corrupt(kind, rng, data)
            header, tensors = fuzz.unpack(c.data)
            dense_sorted = (lambda h: dict(h, dense=sorted(h["dense"], key=fuzz.canonical_json))
                            if isinstance(h, dict) and isinstance(h.get("dense"), list) else h)
            # an independent reading of the edited bytes: same header up to the dense order, same tensor bits
            unchanged = (fuzz.canonical_json(dense_sorted(header)) == fuzz.canonical_json(dense_sorted(header0))
                         and set(tensors) == set(tensors0)
                         and all(tensors[k].dtype == tensors0[k].dtype and tensors[k].shape == tensors0[k].shape
                                 and tensors[k].view(-1).view(fuzz._INT_OF_SIZE[tensors[k].element_size()]).equal(
                                     tensors0[k].view(-1).view(fuzz._INT_OF_SIZE[tensors0[k].element_size()]))
                                 for k in tensors))
            assert c.same_meaning == unchanged, (kind, c.description)
            key = "real" if not unchanged else "same bytes" if c.data == data else "same meaning, other bytes"
            seen[key] += 1
    assert all(seen.values()), seen  # every case occurred


def test_corruption_count_is_exact(fuzz):
    """Every corruption slot is either decoded once (one outcome) or, after ``MAX_DRAWS`` no-ops, left out."""
    s = fuzz.run(120, seed=5)
    assert s.failed == 0, fuzz.format_summary(s)
    assert s.corrupted + sum(s.no_op.values()) == 120 * 3
    for kind in ("byte_flip", "multi_flip", "truncate", "extend", "garbage", "respell", "header_edit",
                 "swap_tensors", "header_edit_rehash_illtyped", "header_edit_rehash_extra"):
        assert set(s.outcomes[kind]) == {"rejected"}, (kind, dict(s.outcomes[kind]))

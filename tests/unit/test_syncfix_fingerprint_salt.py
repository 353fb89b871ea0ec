"""Fingerprints salted with the weight version: successive drift checks sample different rows, so a
divergence in any row is caught within about ``n_rows / rows_per_tensor`` checks (unsalted, a tensor's
sample is the same rows at every version and a divergence elsewhere is never seen)."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync import ModuleEngine, drift
from megatron_logra.sync.fingerprint import fingerprint, fingerprint_salt, sample_rows
from megatron_logra.sync.sglang_fingerprint import engine_fingerprint
from megatron_logra.sync.sglang_loader import engine_hf_view
from support.sglang_stand_ins import SGLangLlama, hf_state

NAME = "model.layers.0.mlp.down_proj.weight"


class _One(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)


def test_salted_samples_cover_every_row_over_successive_versions():
    n, k = 64, 4
    assert sample_rows(NAME, n, k) == sample_rows(NAME, n, k)  # unsalted: one fixed sample
    seen: set[int] = set()
    versions = 0
    while len(seen) < n:
        versions += 1
        rows = sample_rows(NAME, n, k, salt=versions)
        assert rows == sample_rows(NAME, n, k, salt=versions) and 0 in rows and n - 1 in rows
        seen.update(rows)
        assert versions <= 4 * n, "successive salts do not cover the rows"
    assert len({tuple(sample_rows(NAME, n, k, salt=v)) for v in range(1, 20)}) > 15


def test_a_drifted_row_outside_the_fixed_sample_is_caught_within_about_n_over_k_checks():
    n = 256
    w = torch.randn(n, 16).bfloat16()
    bad = next(i for i in range(n) if i not in sample_rows("w", n))  # never compared without a salt
    drifted = w.clone()
    drifted[bad] += 1.0
    engine = ModuleEngine(_One(drifted))
    assert drift(fingerprint({"w": w}), fingerprint({"w": drifted})) == []  # the blind spot of a fixed sample
    caught = None
    for version in range(1, 4 * n // 4 + 1):  # one drift check per weight version
        engine.reset_version(version)
        engine_fp = engine.fingerprint()
        assert fingerprint_salt(engine_fp) == version
        if drift(fingerprint({"w": w}, salt=fingerprint_salt(engine_fp)), engine_fp):
            caught = version
            break
        assert drift(fingerprint({"w": w}, salt=version), fingerprint({"w": w.clone()}, salt=version)) == []
    assert caught is not None, "the drifted row was never sampled"


def test_salted_digests_carry_their_salt_and_never_equal_another_salts():
    state = {"a": torch.randn(8, 3), "b": torch.randn(5), "c": torch.tensor(2.0)}
    plain, at_3, at_4 = fingerprint(state), fingerprint(state, salt=3), fingerprint(state, salt=4)
    assert fingerprint_salt(plain) is None and fingerprint_salt(at_3) == 3 and fingerprint_salt(at_4) == 4
    assert fingerprint_salt(None) is None and fingerprint_salt({}) is None
    assert all(v.endswith("@3") for v in at_3.values()) and all("@" not in v for v in plain.values())
    assert drift(plain, at_3) == drift(at_3, at_4) == ["a", "b", "c"]  # same rows of b, c: only the salt differs
    assert fingerprint(state, salt=3) == at_3
    with pytest.raises(ValueError, match="salt"):
        fingerprint(state, salt=True)


def test_the_sglang_engine_fingerprint_takes_the_same_salt():
    model = SGLangLlama(hf_state(1), vocab_pad=24)
    view = engine_hf_view(model)
    assert engine_fingerprint(model, salt=7) == fingerprint(view, salt=7)
    assert engine_fingerprint(model) == fingerprint(view)

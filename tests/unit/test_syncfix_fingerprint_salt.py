"""Fingerprints salted with the weight version: the rows sampled at successive versions sweep a fixed
permutation of each tensor's rows, so a divergence in any row is caught within ``W`` checks (``W`` the smallest
prime >= ``max(n_rows / rows_per_tensor, 31)``), at consecutive versions or every ``c`` versions (unsalted, a tensor's
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


def _windows(n: int, k: int) -> int:
    """The smallest prime >= max(ceil(n / k), 31): the checks a sweep of an n-row tensor takes."""
    w = max(31, -(-n // k))
    while any(w % f == 0 for f in range(2, int(w ** 0.5) + 1)):
        w += 1
    return w


@pytest.mark.parametrize("n, k", [(64, 4), (4096, 4), (1000, 7), (9, 4), (8, 4)])
def test_salted_samples_sweep_every_row_in_one_pass(n, k):
    assert sample_rows(NAME, n, k) == sample_rows(NAME, n, k)  # unsalted: one fixed sample
    windows = _windows(n, k)
    for every in (1, 2, 3, 8):  # sync.check_interval: checks at versions every, 2 * every, ...
        seen: set[int] = set()
        for check in range(1, windows + 1):
            rows = sample_rows(NAME, n, k, salt=every * check)
            assert rows == sample_rows(NAME, n, k, salt=every * check) and 0 in rows and n - 1 in rows
            assert len(rows) <= k + 2
            seen.update(rows)
        assert seen == set(range(n)), f"{windows} checks every {every} versions missed {n - len(seen)} rows"
    # consecutive windows do not overlap until the sweep wraps: n / k checks sample ~n distinct rows
    firsts = [set(sample_rows(NAME, n, k, salt=v)) - {0, n - 1} for v in range(n // k)]
    assert len(set().union(*firsts)) >= n - 2 - k


def test_small_tensors_and_no_sampled_rows():
    assert sample_rows(NAME, 3, 4, salt=5) == [0, 1, 2]  # fewer rows than the sample: all of them
    assert sample_rows(NAME, 1, 4, salt=-1) == [0]
    assert sample_rows(NAME, 8, 0, salt=3) == [0, 7]
    assert sample_rows(NAME, 0, 4) == []


def test_a_drifted_row_outside_the_fixed_sample_is_caught_within_one_sweep():
    n = 256
    w = torch.randn(n, 16).bfloat16()
    bad = next(i for i in range(n) if i not in sample_rows("w", n))  # never compared without a salt
    drifted = w.clone()
    drifted[bad] += 1.0
    engine = ModuleEngine(_One(drifted))
    assert drift(fingerprint({"w": w}), fingerprint({"w": drifted})) == []  # the blind spot of a fixed sample
    caught = None
    for version in range(1, _windows(n, 4) + 1):  # one drift check per weight version
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

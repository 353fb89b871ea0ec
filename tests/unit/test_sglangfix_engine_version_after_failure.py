"""``SGLangEngine.weight_version`` after a failed weight update is the engine's real version, read back from its
loader (``weight_version = -1``, unknown, when it cannot be read), never the version from before the update.

The engine is the real client (``SGLangEngineTarget``) and sketch-delta loader (``sync_loader``) over the
CPU stand-ins of SGLang's side (``support.sglang_stand_ins``: ``sglang.Engine``'s weight-update surface, its
scheduler's loader dispatch, a model laid out like SGLang's Qwen2). Weights are compared bitwise with the
trainer's apply of the same deltas to the Hugging Face state, loaded by SGLang's default loader (an
independent reference)."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.rollout.sglang_engine import SGLangEngine
from megatron_logra.sync import SyncError
from megatron_logra.sync.sglang_client import SGLangEngineTarget, SGLangError
from megatron_logra.sync.sglang_loader import LOADER_PATH, TENSOR_NAME, engine_version
from megatron_logra.sync.synthetic import random_delta
from support.sglang_stand_ins import SHAPE, V, FakeEngine, FakeSGLang, SchedulerRuntime, SGLangQwen2, delta_chain, \
    hf_state, reference

BROKEN = "model.layers.1.mlp.down_proj.weight"  # the last weight a commit writes


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _setup():
    hf = hf_state()
    model = SGLangQwen2(hf)
    target = SGLangEngineTarget(FakeEngine(SchedulerRuntime([model])))
    engine = SGLangEngine(generate_fn=FakeSGLang(), target=target, vocab_size=V, padded_vocab_size=V)
    assert engine.weight_version == 0
    return hf, model, target, engine


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("logra_sync_")}


def _differ(model, expect: dict[str, torch.Tensor]) -> list[str]:
    mine = _weights(model)
    assert mine.keys() == expect.keys()
    return [n for n in expect if not torch.equal(mine[n], expect[n])]


def _holds(model, hf_state_) -> list[str]:
    """The weights ``model`` holds that differ from ``hf_state_`` loaded by SGLang's default loader."""
    return _differ(model, _weights(SGLangQwen2(hf_state_)))


def test_a_commit_that_fails_part_way_reads_back_as_unknown_until_a_refit():
    hf, model, target, engine = _setup()
    d1, d2, d3 = delta_chain(3)
    assert engine.apply_sketch_delta(d1) == 1 and engine.weight_version == 1

    # rejected before any write: the engine kept its version and weights, and says so
    nonfinite = random_delta(SHAPE, 8, base_version=1, new_version=2, generator_seed=4, scale=2e-3)
    nonfinite.targets[0].U_OR[:, 0] = float("nan")
    with pytest.raises(SyncError):
        engine.apply_sketch_delta(nonfinite)
    assert engine.weight_version == 1 == engine_version(model) and _holds(model, reference(hf, [d1])) == []

    p = dict(model.named_parameters())[BROKEN]
    own = p.data
    p.data = own[:1].expand_as(own)  # every row is row 0: in-place kernels refuse to write it
    with pytest.raises(SyncError) as exc:
        engine.apply_sketch_delta(d2)
    assert exc.value.kind == "apply"
    p.data = own
    assert _holds(model, reference(hf, [d1])), "the commit wrote some weights before it failed"
    assert engine_version(model) == -1
    assert engine.weight_version == -1 and target.weight_version == -1  # not 1: those weights are gone

    once = _weights(model)
    with pytest.raises(SyncError, match="not sent to SGLang"):
        engine.apply_sketch_delta(d2)  # never merged a second time
    assert engine.weight_version == -1 and _differ(model, once) == []

    engine.update_weights_full(reference(hf, [d1]), 1)
    assert engine.weight_version == 1 == engine_version(model)
    assert engine.apply_sketch_delta(d2) == 2 and engine.apply_sketch_delta(d3) == 3
    assert engine.weight_version == 3 and _holds(model, reference(hf, [d1, d2, d3])) == []
    assert target.engine.runtime.dead is None


def test_a_lost_answer_reads_back_the_version_the_engine_reached():
    hf, model, target, engine = _setup()
    d1, d2 = delta_chain(2)
    real_update = target._update

    def answer_lost(named_tensors, load_format, flush_cache):  # the engine applied it; the reply never came
        real_update(named_tensors, load_format, flush_cache)
        if load_format == LOADER_PATH and TENSOR_NAME in [n for n, _ in named_tensors]:
            return False, "connection reset by peer"
        return True, "Success"

    target._update = answer_lost
    with pytest.raises(SGLangError, match="connection reset"):
        engine.apply_sketch_delta(d1)
    target._update = real_update
    assert engine_version(model) == 1 and _holds(model, reference(hf, [d1])) == []
    assert engine.weight_version == 1  # what the engine holds, not the 0 it held before
    assert engine.apply_sketch_delta(d2) == 2 and _holds(model, reference(hf, [d1, d2])) == []


def test_an_engine_that_cannot_be_read_after_a_failure_is_at_an_unknown_version():
    hf, model, target, engine = _setup()
    d1, d2 = delta_chain(2)
    assert engine.apply_sketch_delta(d1) == 1
    real_update, real_read = target._update, target._read_param

    def down(*args, **kwargs):
        raise ConnectionError("engine unreachable")

    target._update, target._read_param = down, down
    with pytest.raises(ConnectionError):
        engine.apply_sketch_delta(d2)
    assert engine.weight_version == -1  # cannot say which weights it holds: every delta is refused until a refit
    target._update, target._read_param = real_update, real_read
    engine.update_weights_full(reference(hf, [d1]), 1)
    assert engine.weight_version == 1 and engine.apply_sketch_delta(d2) == 2
    assert _holds(model, reference(hf, [d1, d2])) == []


def test_a_refit_that_fails_part_way_reads_back_as_unknown():
    hf, model, target, engine = _setup()
    (d1,) = delta_chain(1)
    assert engine.apply_sketch_delta(d1) == 1
    target.chunk_bytes = 4096
    real_update = target._update
    dense = []

    def flaky(named_tensors, load_format, flush_cache):
        if load_format is None:
            dense.append(1)
            if len(dense) == 2:
                return False, "connection reset by peer"
        return real_update(named_tensors, load_format, flush_cache)

    target._update = flaky
    new = hf_state(seed=5)
    with pytest.raises(SGLangError, match="full refit to version 7 failed"):
        engine.update_weights_full(new, 7)
    assert engine_version(model) == -1 and engine.weight_version == -1  # not 1: part of the weights are 7's
    target._update = real_update
    engine.update_weights_full(new, 7)
    assert engine.weight_version == 7 and _holds(model, new) == []

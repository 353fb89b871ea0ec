"""EmbeddedEngine: a dense refit whose copy fails part-way keeps ``update_weights_full``'s contract, and
prompt ids are checked against the model's vocabulary, not the padded one (as the SGLang engine does).

The failing copies are real ones: a meta tensor (no data: ``copy_`` raises ``NotImplementedError``) and a
sparse tensor (``copy_`` from sparse into a dense parameter raises), each with the right name and shape.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.rollout.embedded import EmbeddedEngine
from megatron_logra.rollout.engine import SamplingParams

CFG = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  vocab_size=60, seq_length=16, init_std=0.1, layernorm_epsilon=1e-5)
"""vocab_size 60, padded to 64: ids 60..63 are padding columns, no tokens."""


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _state(engine: EmbeddedEngine, value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full(s, value) for n, s in engine.expected_shapes().items()}


def _params(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("bad", ["meta", "sparse"])
def test_a_mapping_whose_copy_fails_part_way_marks_the_version_unknown(bad):
    engine = EmbeddedEngine(CFG)
    engine.update_weights_full(_state(engine, 0.5), version=2)
    names = list(engine.expected_shapes())
    state = _state(engine, 7.0)
    last = names[-1]
    state[last] = torch.empty(state[last].shape, device="meta") if bad == "meta" else \
        torch.zeros(state[last].shape).to_sparse()
    with pytest.raises(ValueError, match=rf"{last.replace('.', '[.]')}: copy failed .*weight_version = -1"):
        engine.update_weights_full(state, version=3)
    assert engine.weight_version == -1  # some tensors were replaced: the weights are no known version
    engine.update_weights_full(_state(engine, 1.0), version=3)  # a clean refit restores a known version
    assert engine.weight_version == 3


def test_a_copy_failing_on_the_first_tensor_leaves_the_engine_untouched():
    engine = EmbeddedEngine(CFG)
    engine.update_weights_full(_state(engine, 0.5), version=2)
    before = _params(engine)
    first = next(iter(engine.expected_shapes()))
    state = _state(engine, 7.0)
    assert next(iter(state)) == first
    state[first] = torch.empty(engine.expected_shapes()[first], device="meta")
    with pytest.raises(ValueError, match=rf"{first.replace('.', '[.]')}: copy failed"):
        engine.update_weights_full(state, version=3)
    assert engine.weight_version == 2
    assert all(torch.equal(p, before[n]) for n, p in _params(engine).items())


def test_a_stream_whose_copy_fails_is_consumed_to_its_end():
    engine = EmbeddedEngine(CFG)
    good = _state(engine, 0.25)
    names = list(good)
    pulled: list[str] = []

    def stream():
        for i, name in enumerate(names):
            pulled.append(name)
            yield name, (torch.empty(good[name].shape, device="meta") if i == 2 else good[name])

    with pytest.raises(ValueError, match=rf"{names[2].replace('.', '[.]')}: copy failed .*weight_version = -1"):
        engine.update_weights_full(stream(), version=1)
    assert pulled == names  # every tensor was pulled: the producer's collectives all ran
    assert engine.weight_version == -1
    after = _params(engine)
    assert all(torch.equal(after[n], good[n]) for n in names[:2])  # copied before the failure
    assert not any(torch.equal(after[n], good[n]) for n in names[3:])  # nothing copied after it


def test_values_that_are_not_tensors_are_named():
    engine = EmbeddedEngine(CFG)
    state: dict = _state(engine, 1.0)
    name = next(iter(state))
    state[name] = [[0.0]]
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: not a tensor \(list\)"):
        engine.update_weights_full(state, version=1)
    with pytest.raises(ValueError, match=r"not a tensor \(NoneType\)"):
        engine.update_weights_full(iter([(name, None)]), version=1)
    assert engine.weight_version == 0


def test_prompt_ids_in_the_padded_vocabulary_are_refused():
    engine = EmbeddedEngine(CFG)
    assert engine.vocab_size == 64 and CFG.vocab_size == 60
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    assert len(engine.generate([[59, 1]], params)) == 1  # the last real token
    for bad in (60, 63, 64):
        with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, model\.vocab_size=60\)"):
            engine.generate([[1, bad]], params)
        with pytest.raises(ValueError, match=r"sequence 1 has token ids outside \[0, model\.vocab_size=60\)"):
            engine.logprobs_of([[1, 2], [1, bad]], [1, 1])
    assert len(engine.logprobs_of([[1, 59]], [1])[0]) == 1


def _vocab_cut(engine: EmbeddedEngine, rows: int, value: float) -> dict[str, torch.Tensor]:
    """A full state whose embed_tokens/lm_head hold ``rows`` vocabulary rows (a directory refit file's cut)."""
    from megatron_logra.sync.layout import VOCAB_PARALLEL

    return {n: torch.full((rows, *s[1:]) if n in VOCAB_PARALLEL else s, value)
            for n, s in engine.expected_shapes().items()}


@pytest.mark.parametrize("stream", [False, True])
def test_the_model_vocabulary_without_the_padding_rows_fills_the_first_rows(stream):
    engine = EmbeddedEngine(CFG)
    engine.update_weights_full(_state(engine, 0.5), version=1)
    state = _vocab_cut(engine, CFG.vocab_size, 2.0)
    engine.check_full_shapes({n: tuple(t.shape) for n, t in state.items()})  # accepted: raises nothing
    engine.update_weights_full(iter(state.items()) if stream else state, version=2)
    assert engine.weight_version == 2
    for name, p in engine.model.named_parameters():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert p.shape[0] == 64 and bool((p[:60] == 2.0).all()) and bool((p[60:] == 0.5).all())
        else:
            assert bool((p == 2.0).all()), name


def test_fewer_rows_than_the_model_vocabulary_are_refused_and_change_nothing():
    from megatron_logra.sync.errors import SyncError

    engine = EmbeddedEngine(CFG)
    engine.update_weights_full(_state(engine, 0.5), version=1)
    before = _params(engine)
    state = _vocab_cut(engine, CFG.vocab_size - 1, 2.0)
    with pytest.raises(SyncError, match=r"model\.embed_tokens\.weight: \(59, 32\) != \(64, 32\).*60 to 64 rows"):
        engine.check_full_shapes({n: tuple(t.shape) for n, t in state.items()})
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: shape \(59, 32\) != \(64, 32\)"):
        engine.update_weights_full(state, version=2)
    assert engine.weight_version == 1
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    wide = {n: torch.full((t.shape[0], t.shape[1] + 1) if t.dim() == 2 else t.shape, 2.0) if "embed" in n else t
            for n, t in _vocab_cut(engine, CFG.vocab_size, 2.0).items()}
    with pytest.raises(SyncError, match="embed_tokens"):  # only the row count may differ
        engine.check_full_shapes({n: tuple(t.shape) for n, t in wide.items()})


def test_the_fingerprint_covers_vocab_rows_when_given():
    engine = EmbeddedEngine(CFG, vocab_rows=CFG.vocab_size)
    engine.update_weights_full(_state(engine, 0.5), version=1)
    assert engine.fingerprint_vocab_rows == CFG.vocab_size
    before = engine.fingerprint(rows_per_tensor=64)
    with torch.no_grad():
        engine.model.get_input_embeddings().weight[60:] += 1.0  # a padding row: not covered
    assert engine.fingerprint(rows_per_tensor=64) == before
    with torch.no_grad():
        engine.model.get_input_embeddings().weight[59] += 1.0  # a vocabulary row
    assert engine.fingerprint(rows_per_tensor=64)["model.embed_tokens.weight"] != before["model.embed_tokens.weight"]
    every = EmbeddedEngine(CFG)  # the default: every row, padding included
    every.update_weights_full(_state(every, 0.5), version=1)
    assert every.fingerprint_vocab_rows is None
    fp = every.fingerprint(rows_per_tensor=64)
    with torch.no_grad():
        every.model.get_input_embeddings().weight[63] += 1.0
    assert every.fingerprint(rows_per_tensor=64)["model.embed_tokens.weight"] != fp["model.embed_tokens.weight"]
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="vocab_rows"):
            EmbeddedEngine(CFG, vocab_rows=bad)

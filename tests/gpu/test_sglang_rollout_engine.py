"""The SGLang rollout engine on a real ``sglang.Engine`` (skipped without CUDA or without sglang).

A tiny random Llama is built with ``transformers`` and served by an in-process ``sglang.Engine``
with the sketch-delta loader (``tools/sglang_sync_smoke.py`` makes both). Through
:class:`~megatron_logra.rollout.sglang_engine.SGLangEngine`:

* sampled rollouts carry log-probs that match ``log_softmax(z / T)`` recomputed by a fp32
  ``transformers`` forward of the same weights (the trainer's convention) within bf16 tolerance;
* one sketch delta moves the engine to version 1, its fingerprint equals the CPU reference apply's,
  and the log-probs of the next rollouts match the *new* weights (and not the old ones).

Under ``slow``: ``tools/sglang_rollout_smoke.py`` runs two RL updates of the tiny recipe with
``rl.rollout.engine=sglang`` end to end, with a bfloat16 trainer (``smoke_config``: the in-process
engine runs in ``model.params_dtype`` and SGLang's kernels are fp16/bf16 only).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_TOOLS = Path(__file__).resolve().parents[2] / "tools"
PROMPTS = [[1, 15, 27, 300, 42, 7, 99], [5, 6, 7, 8], [200, 201, 3], [11, 12]]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, _TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("sglang")
    smoke = _load_tool("sglang_sync_smoke")
    path = tmp_path_factory.mktemp("tiny-llama") / "ckpt"
    state = smoke.build_checkpoint(path, smoke.TINY)
    driver = smoke.EngineDriver(str(path))
    yield smoke, path, state, driver
    driver.close()


def _hf_logprobs(path: Path, state: dict, rollouts, temperature: float) -> list[list[float]]:
    """fp32 transformers forward of ``state`` (the trainer side's log_softmax(z / T))."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model = model.cuda().eval()
    out = []
    with torch.no_grad():
        for r in rollouts:
            seq = torch.tensor([r.prompt_ids + r.completion_ids], device="cuda")
            logp = torch.log_softmax(model(seq).logits[0].double() / temperature, dim=-1)
            n = len(r.prompt_ids)
            out.append([float(logp[t - 1, seq[0, t]]) for t in range(n, seq.shape[1])])
    return out


def _gap(rollouts, ref) -> float:
    diffs = [abs(a - b) for r, lp in zip(rollouts, ref) for a, b in zip(r.logprobs, lp)]
    return sum(diffs) / len(diffs)


def test_rollout_logprobs_match_trainer_and_follow_a_sketch_delta(served):
    from megatron_logra.rollout.engine import SamplingParams
    from megatron_logra.rollout.sglang_engine import SGLangEngine
    from megatron_logra.sync import encode
    from megatron_logra.sync.fingerprint import drift, fingerprint, fingerprint_salt

    smoke, path, state, driver = served
    vocab = smoke.TINY.vocab
    engine = SGLangEngine(generate_fn=lambda payload: driver.engine.generate(**payload), target=driver.target,
                          vocab_size=vocab, padded_vocab_size=vocab)
    assert engine.weight_version == 0
    params = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=12, seed=3)
    before = engine.generate(PROMPTS, params)
    assert [r.prompt_ids for r in before] == PROMPTS
    assert all(r.weight_version == 0 for r in before)
    # SGLang also stops at the checkpoint's own EOS (id 2, generation_config) without being asked to
    assert all((len(r.completion_ids) == 12 and not r.finished)
               or (r.finished and r.completion_ids[-1] == 2 and len(r.completion_ids) <= 12) for r in before)
    gap_before = _gap(before, _hf_logprobs(path, state, before, 0.8))
    assert gap_before < 0.05, f"SGLang log-probs differ from log_softmax(z/T) by {gap_before:.4f} per token"

    (delta,) = smoke.make_deltas(smoke.TINY, 1, rank=16, scale=5e-2)
    assert engine.apply_sketch_delta(encode(delta)) == 1 and engine.weight_version == 1
    ref = smoke.reference(state, [delta])
    fp = engine.fingerprint()
    assert fp is not None and fingerprint_salt(fp) == 1  # the loader samples the rows of the engine's version
    assert not drift(fp, fingerprint(ref, salt=1))

    after = engine.generate(PROMPTS, params)
    assert all(r.weight_version == 1 for r in after)
    gap_new = _gap(after, _hf_logprobs(path, ref, after, 0.8))
    gap_old = _gap(after, _hf_logprobs(path, state, after, 0.8))
    assert gap_new < 0.05 and gap_new < gap_old, (gap_new, gap_old)

    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[2]))
    gap_greedy = _gap(greedy, _hf_logprobs(path, ref, greedy, 1.0))  # greedy reports softmax(z)
    assert gap_greedy < 0.05


@pytest.mark.slow
def test_rl_updates_with_sglang_rollouts(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("sglang")
    res = _load_tool("sglang_rollout_smoke").run(2, run_dir=tmp_path / "run")
    assert res["passed"], res["failures"]


def test_engine_calls_leave_the_trainers_sigterm_handler(served):
    """A real engine's requests register SGLang's SIGTERM handler on its event loop (its tokenizer manager's
    first request); through ``TrainerSignalEngine`` (how ``sglang_launch`` starts it) the trainer's stays."""
    import signal

    from megatron_logra.rollout.sglang_env import TrainerSignalEngine

    smoke, path, state, driver = served
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        mine = signal.getsignal(signal.SIGTERM)
        engine = TrainerSignalEngine(driver.engine)
        out = engine.generate(input_ids=PROMPTS[:1], sampling_params={"temperature": 0.0, "max_new_tokens": 2})
        assert out and signal.getsignal(signal.SIGTERM) is mine
        assert driver.engine.loop.remove_signal_handler(signal.SIGTERM) is False  # SGLang's was taken back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_extra_stop_token_ids_end_sglang_completions(served):
    """``rl.rollout.stop_token_ids`` reach SGLang's sampling params: a completion holds a stop id only as its last
    token, and then it is finished."""
    from collections import Counter

    from megatron_logra.rollout.engine import SamplingParams
    from megatron_logra.rollout.sglang_engine import SGLangEngine

    smoke, _, _, driver = served
    vocab = smoke.TINY.vocab
    engine = SGLangEngine(generate_fn=lambda payload: driver.engine.generate(**payload), target=driver.target,
                          vocab_size=vocab, padded_vocab_size=vocab)
    free = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, seed=5))
    common = Counter(t for r in free for t in r.completion_ids[:-1]).most_common(2)
    stops = [t for t, _ in common]
    stopped = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, seed=5,
                                                      stop_token_ids=stops))
    for r in stopped:
        inside = [t for t in r.completion_ids[:-1] if t in stops]
        assert not inside, (r.completion_ids, stops)
        if r.completion_ids and r.completion_ids[-1] in stops:
            assert r.finished

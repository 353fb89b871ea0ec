"""The held-out evaluation generates up to ``rl.rollout.eval_max_new_tokens`` tokens per completion with the real
embedded engine: longer answers than training's ``rl.rollout.max_new_tokens`` (in the completions scored and in the
sample log), never more than the evaluation's cap, while training rollouts keep their own cap; 0 generates exactly
what the evaluation generated before the field existed (up to ``max_new_tokens``)."""

from __future__ import annotations

import pytest

from support.jsonl_rows import write_rows

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

TRAIN_CAP, EVAL_CAP = 2, 12


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Components whose policy is the untrained random model (it rarely samples a stop token, so completions run
    to their cap), with a 6-row benchmark; the evaluation's cap is 12 tokens, training's 2."""
    from support.run_fixtures import rl_components

    root = tmp_path_factory.mktemp("evallen")
    train = write_rows(root / "train.jsonl", [(f"a {i} a", str(i)) for i in range(64)])
    bench = write_rows(root / "bench.jsonl", [(f"a {i} a", str(i)) for i in range(100, 106)])
    with rl_components(root / "run", ["sft.steps=0", "rl.prompts_per_step=2", "rl.group_size=2",
                                      "rl.micro_batch_size=4", f"task.datasets={train}", f"task.eval_datasets={bench}",
                                      "model.seq_length=32", f"rl.rollout.max_new_tokens={TRAIN_CAP}",
                                      f"rl.rollout.eval_max_new_tokens={EVAL_CAP}"]) as (comps, _):
        yield comps, root


def _evaluate(comps, monkeypatch, log_dir=None) -> tuple[list[str], list[dict]]:
    """The completions the held-out evaluation scores, in order, and (with ``log_dir``) its sample log records."""
    from megatron_logra.rl.evaluation import evaluate_held_out
    from megatron_logra.rl.sample_log import SampleLog

    seen: list[str] = []

    def score(problem, completion):
        seen.append(completion)
        return 0.0, False

    monkeypatch.setattr(comps.task, "score", score)
    log = SampleLog(log_dir, 6) if log_dir is not None else None
    monkeypatch.setattr(comps, "sample_log", log)
    evaluate_held_out(comps, step=0)
    records = []
    if log is not None:
        import json

        records = [json.loads(line) for line in log.path.read_text().splitlines()]
    return seen, records


def test_the_evaluation_generates_past_the_training_cap_up_to_its_own(built, monkeypatch):
    comps, root = built
    completions, records = _evaluate(comps, monkeypatch, root / "long")
    lengths = [r["completion_tokens"] for r in records]
    assert len(completions) == len(records) == 6 and [r["completion"] for r in records] == completions
    assert all(r["split"] == "eval" for r in records)
    assert max(lengths) > TRAIN_CAP and max(lengths) <= EVAL_CAP, lengths
    assert all(n == EVAL_CAP for n, r in zip(lengths, records) if not r["finished"])  # cut at the evaluation's cap


def test_zero_evaluates_exactly_as_before_and_training_keeps_its_cap(built, monkeypatch):
    """``eval_max_new_tokens=0``: the completions of the evaluation as it was (the engine asked for
    ``max_new_tokens``), the same as an explicit ``eval_max_new_tokens=max_new_tokens``, and each the start of the
    longer evaluation's (greedy). A training round samples ``max_new_tokens`` whatever the evaluation's cap."""
    from megatron_logra.rl.prompts import _decode, _prompt_batch
    from megatron_logra.rl.rollout_stage import _sample_round
    from megatron_logra.rollout.engine import SamplingParams

    comps, root = built
    longer, _ = _evaluate(comps, monkeypatch)
    rollouts = _sample_round(comps, 1, 0, 2, 0, None)[1]  # training rollouts, with the evaluation's cap set
    assert [len(r.completion_ids) for r in rollouts] == [TRAIN_CAP] * 4
    rollout = comps.cfg.rl.rollout
    monkeypatch.setattr(rollout, "eval_max_new_tokens", 0)
    zero, records = _evaluate(comps, monkeypatch, root / "zero")
    assert max(r["completion_tokens"] for r in records) <= TRAIN_CAP
    problems = comps.task.eval_problems()  # before the field: generate max_new_tokens for the same prompts
    params = SamplingParams(temperature=rollout.eval_temperature, top_p=rollout.eval_top_p,
                            max_new_tokens=rollout.max_new_tokens, stop_token_ids=comps.stop_token_ids(),
                            seed=comps.cfg.train.seed)
    generated = comps.engine.generate(_prompt_batch(comps, problems, 1), params)
    before = [_decode(comps, r.completion_ids) for r in generated]
    assert zero == before
    monkeypatch.setattr(rollout, "eval_max_new_tokens", TRAIN_CAP)
    assert _evaluate(comps, monkeypatch)[0] == zero
    assert all(long.startswith(short) for long, short in zip(longer, zero)) and longer != zero

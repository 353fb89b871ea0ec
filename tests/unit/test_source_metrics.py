"""Per-source metrics of a task mixture: each step's reward and accuracy per source of its rollouts and the
held-out accuracy per source (``accuracy/SOURCE``, ``eval_accuracy/SOURCE``), on the real CPU components with a
mixture of two ``jsonl:`` files; none for a task of one source."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def test_sums_and_fields_against_a_plain_count():
    from megatron_logra.rl.source_metrics import source_fields, source_sums

    names = ["chain_sum", "gcd", "jsonl:/data/x/math500.jsonl"]
    problems = [SimpleNamespace(source=s) for s in ["gcd", "chain_sum", "gcd", "gcd", "chain_sum"]]
    scored = [(1.0, True), (-0.01, False), (0.5, False), (1.0, True), (1.0, True)]
    sums = source_sums(names, problems, scored)
    fields = source_fields(names, sums, reward="reward_mean", accuracy="accuracy")
    for name in ("chain_sum", "gcd"):
        mine = [sc for p, sc in zip(problems, scored) if p.source == name]
        assert fields[f"reward_mean/{name}"] == pytest.approx(sum(r for r, _ in mine) / len(mine))
        assert fields[f"accuracy/{name}"] == pytest.approx(sum(ok for _, ok in mine) / len(mine))
    assert fields["accuracy/jsonl:math500.jsonl"] is None and fields["reward_mean/jsonl:math500.jsonl"] is None
    assert set(source_fields(names, sums, accuracy="eval_accuracy")) == {
        "eval_accuracy/chain_sum", "eval_accuracy/gcd", "eval_accuracy/jsonl:math500.jsonl"}
    assert source_fields(["chain_sum"], torch.ones(1, 3), accuracy="accuracy") == {}


def test_field_names_keep_one_group_per_metric():
    from megatron_logra.rl.source_metrics import field_names

    assert field_names(["chain_sum", "jsonl:/a/b/train.jsonl"]) == ["chain_sum", "jsonl:train.jsonl"]
    assert field_names(["jsonl:/a/train.jsonl", "jsonl:/b/train.jsonl"]) == ["jsonl:_a_train.jsonl",
                                                                              "jsonl:_b_train.jsonl"]


def _rows(path, letter: str, n: int = 64) -> str:
    path.write_text("".join(json.dumps({"prompt": f"{letter} {i} {letter}", "answer": str(i)}) + "\n"
                            for i in range(n)))
    return f"jsonl:{path}"


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    from support.run_fixtures import rl_components

    root = tmp_path_factory.mktemp("mixture")
    a, b = _rows(root / "easy.jsonl", "a"), _rows(root / "hard.jsonl", "b")
    with rl_components(root / "run", ["rl.steps=2", "rl.prompts_per_step=8", "rl.group_size=2",
                                      "rl.micro_batch_size=16", f"task.datasets={a},{b}", "task.weights=1,1",
                                      "task.num_eval=8", "model.seq_length=32"]) as built:
        yield built


def test_a_mixture_records_reward_and_accuracy_per_source(mixture, monkeypatch):
    from megatron_logra.rl.evaluation import evaluate_held_out
    from megatron_logra.rl.loop import rl_update

    comps, state = mixture
    seen: list[str] = []

    def score(problem, completion):  # every answer to the easy file is right, every one to the hard file wrong
        seen.append(problem.source)
        return (1.0, True) if problem.source.endswith("easy.jsonl") else (0.25, False)

    monkeypatch.setattr(comps.task, "score", score)
    record = rl_update(comps, state)
    share = seen.count(comps.task.names[0]) / len(seen)
    assert 0 < share < 1  # both sources in the step
    assert (record["accuracy/jsonl:easy.jsonl"], record["accuracy/jsonl:hard.jsonl"]) == (1.0, 0.0)
    assert (record["reward_mean/jsonl:easy.jsonl"], record["reward_mean/jsonl:hard.jsonl"]) == (1.0, 0.25)
    assert record["accuracy"] == pytest.approx(share)
    seen.clear()
    accuracy, by_source = evaluate_held_out(comps)
    assert by_source == {"eval_accuracy/jsonl:easy.jsonl": 1.0, "eval_accuracy/jsonl:hard.jsonl": 0.0}
    assert accuracy == pytest.approx(seen.count(comps.task.names[0]) / len(seen))

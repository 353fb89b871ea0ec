"""A slime reward function receives ``sample.label`` as the row gave it, as slime passes the JSON value: a number
label stays a number (``sample.label == 42`` holds for ``"label": 42``), a string stays the string; in reward worker
processes too. The trainer's own scorers still read the answer's text."""

from __future__ import annotations

import json
import uuid

import pytest

from megatron_logra.rewards import TaskConfig, build_task
from megatron_logra.rl.step_guard import score_rollouts

SLIME_RM = '''
def typed(args, sample):
    """1 when the label is the JSON number 42 or the string "seven", 0 otherwise (a label of another type)."""
    return 1.0 if sample.label == 42 or sample.label == "seven" or sample.label == 2.5 else 0.0
'''

ROWS = [{"prompt": "6*7=", "label": 42}, {"prompt": "word", "label": "seven"}, {"prompt": "5/2=", "label": 2.5},
        {"prompt": "quoted", "label": "42"}]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_number_label_reaches_the_function_as_a_number(tmp_path, monkeypatch, workers):
    name = f"mlogra_slimelabel_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SLIME_RM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the spawned reward workers import it by name too
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    task = build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=f"slime:{name}.typed", num_eval=0,
                                 reward_workers=workers))
    try:
        (source,) = task.sources
        problems = list(source.problems)
        assert [p.answer for p in problems] == ["42", "seven", "2.5", "42"]  # the text the other scorers read
        assert [p.raw_answer for p in problems] == [42, None, 2.5, None]
        assert [r for r, _ in score_rollouts(task, problems, ["x"] * 4, step=1)] == [1.0, 1.0, 1.0, 0.0]
        drawn = source.problem(0)  # a problem drawn for a step keeps it
        assert drawn.raw_answer == 42 and drawn is not problems[0]
    finally:
        task.close()

"""``task.reward_workers``: rewards scored in worker processes equal the in-process ones bit for bit, in order, for
reasoning-gym's own scorer, math-verify on a JSONL file and a user's plugin function; workers start lazily, are
reused from batch to batch and run in processes of their own.

Real reasoning-gym datasets, real math-verify, a real plugin module written into ``tmp_path``; no mocks.
"""

from __future__ import annotations

import json
import os
import struct
import uuid

import pytest

from megatron_logra.rewards import TaskConfig, build_task
from megatron_logra.rl.step_guard import score_rollouts

TINY_SUM = {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}}

MATH_ROWS = [
    ("What is one half?", "\\frac{1}{2}"),
    ("Simplify sqrt(8).", "2\\sqrt{2}"),
    ("Solve x + 3 = 5.", "2"),
    ("What is 10 percent of 35?", "3.5"),
    ("Name the capital of France.", "Paris"),
    ("What is 2/4 as a decimal?", "0.5"),
]
MATH_COMPLETIONS = ["The answer is \\boxed{0.5}.", "\\boxed{\\sqrt{8}}", "x = 2, so the answer is 2",
                    "\\boxed{3}", "<answer>paris</answer>", "\\boxed{\\frac{2}{4}}", "no idea", "\\boxed{2\\sqrt{2}}"]

PLUGIN = '''
import os
import time

PIDS = {pids!r}
BARRIER = {barrier!r}


def graded(problem, completion):
    """A graded score: the share of the answer's characters that the completion holds, in order. On "barrier": 1
    once two processes are in such a call at the same time (0 after 20 s alone)."""
    if completion == "barrier":
        open(os.path.join(BARRIER, str(os.getpid())), "w").close()
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if len(os.listdir(BARRIER)) >= 2:
                return 1.0
            time.sleep(0.01)
        return 0.0
    with open(PIDS, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    answer, text = problem.answer, completion.strip()
    if text == answer:
        return 1.0
    common = sum(1 for a, b in zip(answer, text) if a == b)
    return common / (3.0 * max(len(answer), len(text), 1))
'''


def _bits(scored: list[tuple[float, bool]]) -> list[tuple[bytes, bool]]:
    """The rewards' exact bits (``==`` would let -0.0 equal 0.0)."""
    return [(struct.pack("<d", reward), correct) for reward, correct in scored]


@pytest.fixture(scope="module")
def math_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewardproc") / "math.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": a, "id": i}) + "\n" for i, (q, a) in enumerate(MATH_ROWS)))
    return path


@pytest.fixture(scope="module")
def mixed(math_file):
    """``(in-process task, task of 2 workers)`` over chain_sum (its own scorer) and a JSONL file (math-verify)."""
    kwargs = dict(datasets=["chain_sum", f"jsonl:{math_file}"], dataset_kwargs=TINY_SUM, num_eval=0, seed=3,
                  eval_modulus=1000)
    here, there = build_task(TaskConfig(**kwargs)), build_task(TaskConfig(**kwargs, reward_workers=2))
    yield here, there
    there.close()


def _batch(task, math_file):
    """A batch of both sources: chain_sum answers exact, tagged, partial (reasoning-gym's graded credit) and wrong;
    every math row under several completions."""
    from megatron_logra.rewards import load_jsonl_problems

    gym = [task.train_problem(i) for i in range(60)]
    gym = [p for p in gym if p.source == "chain_sum"][:24]
    completions = []
    for i, p in enumerate(gym):
        completions.append([p.answer, f"Thinking...\n<answer>{p.answer}</answer>", f"{p.answer}7",
                            f"<answer>{p.answer}{p.answer}</answer>", "zz", "-1"][i % 6])
    rows = load_jsonl_problems(str(math_file), source=f"jsonl:{math_file}")
    maths = [(row, text) for row in rows for text in MATH_COMPLETIONS]
    problems = gym + [row for row, _ in maths]
    return problems, completions + [text for _, text in maths]


def test_reasoning_gym_and_math_verify_scores_are_bit_identical_in_order(mixed, math_file):
    here, there = mixed
    problems, completions = _batch(here, math_file)
    assert there.pool.pids() == []  # lazily started: building the task starts nothing
    expected = [here.score(p, c) for p, c in zip(problems, completions)]
    got = list(there.score_each(problems, completions))
    assert _bits(got) == _bits(expected)
    rewards = {r for r, _ in expected}
    assert len(rewards) >= 4 and any(0 < r < 1 for r in rewards)  # graded credit, exact, wrong: a real comparison
    assert sum(c for _, c in expected[24:]) >= 6  # math-verify found equivalent forms (0.5 for \frac{1}{2}, ...)
    pids = there.pool.pids()
    assert len(pids) == 2 and os.getpid() not in pids and len(set(pids)) == 2
    # the RL step's path: score_rollouts over the pool, twice, on the same (reused) workers
    assert _bits(score_rollouts(there, problems, completions, step=1)) == _bits(expected)
    assert _bits(score_rollouts(there, problems[::-1], completions[::-1], step=2)) == _bits(expected[::-1])
    assert there.pool.pids() == pids
    assert _bits([there.score(problems[5], completions[5])]) == _bits([expected[5]])


def test_an_unknown_source_fails_at_its_sample_after_the_earlier_ones(mixed, math_file):
    from megatron_logra.rewards import Problem

    here, there = mixed
    problems, completions = _batch(here, math_file)
    stranger = Problem("What is 1 + 1?", "2", "gcd", {})
    scores = there.score_each(problems[:3] + [stranger], completions[:3] + ["2"])
    assert _bits([next(scores) for _ in range(3)]) == _bits([here.score(p, c) for p, c in zip(problems, completions[:3])])
    with pytest.raises(ValueError, match=r"problem.source='gcd' is not one of this task's sources"):
        next(scores)


def test_a_plugin_function_scores_the_same_in_its_worker_processes(tmp_path, monkeypatch):
    name = f"mlogra_rewardproc_plugin_{uuid.uuid4().hex[:8]}"
    pids_file, barrier = tmp_path / "pids.txt", tmp_path / "barrier"
    barrier.mkdir()
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(pids=str(pids_file), barrier=str(barrier)))
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned worker gets the trainer's sys.path
    kwargs = dict(dataset_kwargs=TINY_SUM, reward=f"{name}:graded", num_eval=0, seed=9, reward_timeout_s=30)
    here, there = build_task(TaskConfig(**kwargs)), build_task(TaskConfig(**kwargs, reward_workers=2))
    try:
        problem = here.train_problem(0)
        # the two calls meet: they run at the same time, in two processes (one worker would wait 20 s alone)
        assert score_rollouts(there, [problem] * 2, ["barrier"] * 2, step=0) == [(1.0, True)] * 2
        assert len(os.listdir(barrier)) == 2 and str(os.getpid()) not in os.listdir(barrier)
        problems = [here.train_problem(i) for i in range(30)]
        completions = [p.answer if i % 4 == 0 else p.answer[::-1] + "1" * (i % 3) for i, p in enumerate(problems)]
        expected = score_rollouts(here, problems, completions, step=1)
        pids_file.write_text("")
        got = score_rollouts(there, problems, completions, step=1)
        assert _bits(got) == _bits(expected)
        assert len({r for r, _ in expected}) >= 3
        scored_in = [int(line) for line in pids_file.read_text().split()]
        assert len(scored_in) == len(problems) and os.getpid() not in scored_in
        assert set(scored_in) <= set(there.pool.pids()) == {int(p) for p in os.listdir(barrier)}
    finally:
        there.close()

"""Tasks and rewards as a user brings them: scores checked against reasoning-gym's own ``score_answer``
and ``math_verify.verify(parse(...), parse(...))`` called directly, and bad task inputs refused at start
(``build_task``, which the CLI reports as ``megatron-logra: error: ...``, exit 2, before the model is built)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from math_verify import parse, verify
from reasoning_gym.utils import extract_answer
from support import forked

from megatron_logra.rewards import MathVerifyScorer, Problem, TaskConfig, build_task, extract_final_answer
from megatron_logra.rewards.base import prompt_bucket
from megatron_logra.rewards.gym import GymScorer, GymSource
from megatron_logra.rewards.task import MAX_TRAIN_ATTEMPTS

ROOT = Path(__file__).resolve().parents[2]


def _reference(gold: str, completion: str) -> float:
    """math-verify on the whole completion, as its README calls it (gold boxed: its strongest anchor)."""
    return float(verify(parse("\\boxed{" + gold + "}"), parse(completion)))


# (gold, completion): math-verify called directly on the whole completion agrees with the scorer
AGREE = [
    ("42", "The answer is:\n42"),  # "answer is:" with the answer on the next line
    ("42", "The answer is: \n\n 42"),
    ("\\frac{1}{2}", "The answer is:\n\n$\\frac{1}{2}$"),
    ("2", "The answer is 2. Because 1+1=2 and then 3"),  # trailing text
    ("2", "\\boxed{2} and some trailing text 7"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),  # fraction vs decimal, both ways
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "<answer> 0.5 </answer>"),
    ("2", "   \n  \\boxed{ 2 }  \n"),  # whitespace
    ("2", ""),  # an empty completion
    ("\\{1, 2\\}", "\\boxed{1, 2}"),  # several answers
    ("1, 2", "\\boxed{2, 1}"),
    ("0.0000001", "\\boxed{10^{-7}}"),
    ("3.14", "\\boxed{\\pi}"),
    ("\\frac{1}{3}", "\\boxed{0.333}"),
    ("5", "Final Answer: The final answer is $5$. I hope it is correct."),
    ("12", "Answer: **12**"),
    ("1000", "The answer is 1,000."),
    ("-5", "So the result is -5"),
    ("10", "$$\\boxed{10}$$"),
]


@pytest.mark.parametrize("gold,completion", AGREE)
def test_math_scores_agree_with_math_verify_called_directly(gold, completion):
    scorer = MathVerifyScorer(timeout_s=5)
    ours = scorer.score(Problem(prompt="q", answer=gold, source="jsonl:x"), completion)
    assert ours == _reference(gold, completion), extract_final_answer(completion)


@pytest.mark.parametrize("completion", ["The answer is:\n42", "The answer is: 42", "My answer is :\n\n42."])
def test_answer_is_colon_is_a_marker(completion):
    """``answer is:`` used to leave its colon as the answer (``':'``, scored wrong)."""
    assert extract_final_answer(completion) == "42"


@pytest.mark.parametrize("gold,completion,expected", [
    ("2", "<answer>2", 1.0),  # never closes its tag: the last number (rule 4)
    ("2", "\\boxed{2", 1.0),  # never closes its box: likewise
    ("3", "<answer>2</answer> <answer>3</answer>", 1.0),  # the last tag wins
    ("2", "<answer>2</answer> <answer>3</answer>", 0.0),
    ("6", "<answer>5</answer> wait, the answer is 6", 0.0),  # a tag before a later "answer is"
    ("2", "<answer>\\boxed{2}</answer> \\boxed{3}", 0.0),  # the last box before any tag
])
def test_documented_extraction_where_math_verify_reads_the_text_otherwise(gold, completion, expected):
    """Where the module's rules differ from math-verify's own extraction, the extracted answer is still
    judged by math-verify directly."""
    scorer = MathVerifyScorer(timeout_s=5)
    assert scorer.score(Problem(prompt="q", answer=gold, source="jsonl:x"), completion) == expected
    extracted = extract_final_answer(completion)
    assert float(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + extracted + "}"))) == expected


@pytest.mark.parametrize("name", ["chain_sum", "spell_backward", "fraction_simplification", "gcd"])
def test_gym_scores_agree_with_reasoning_gym_score_answer(name):
    source = GymSource(name, seed=11)
    scorer = GymScorer(source.dataset, name)
    for i in range(3):
        entry, problem = source.dataset[i], source.problem(i)
        oracle = str(entry["answer"])
        for completion in [f"<answer>{oracle}</answer>", f"<answer>\n {oracle} \n</answer>", oracle, f"  {oracle}\n",
                           f"thinking <answer>{oracle}</answer> and trailing text", f"<answer>{oracle}x</answer>",
                           f"<answer>wrong</answer><answer>{oracle}</answer>", "", f"<answer>{oracle}",
                           "<answer></answer>"]:
            tagged = extract_answer(completion)
            answer = tagged if tagged is not None else completion.strip()
            expected = min(1.0, max(0.0, float(source.dataset.score_answer(answer=answer, entry=entry))))
            assert scorer.score(problem, completion) == expected, (name, i, completion)


def _all_eval_only_chain_sum(seed: int) -> bool:
    """Whether ``task.seed=seed`` with ``chain_sum`` of ``size`` 1 makes its only prompt eval-only (modulus 16)."""
    from megatron_logra.rewards.build import _seed_for

    source = GymSource("chain_sum", _seed_for(seed, "chain_sum", "train"), {"size": 1})
    return prompt_bucket(source.problem(0).prompt, 16) == 0


SIZE_ONE = {"chain_sum": {"size": 1}}


def test_a_gym_dataset_without_training_prompts_is_refused_at_build():
    """A ``size`` of 1 whose only prompt is eval-only: a RuntimeError traceback at the first train draw, now a
    ValueError from ``build_task`` naming the dataset and the fix; another seed trains on that one prompt."""
    seed = next(s for s in range(1, 500) if _all_eval_only_chain_sum(s))
    with pytest.raises(ValueError) as info:
        build_task(TaskConfig(datasets=["chain_sum"], dataset_kwargs=SIZE_ONE, seed=seed, num_eval=0))
    message = str(info.value)
    assert "'chain_sum' has no training prompts: all 1 of its prompts are eval-only" in message
    assert "task.dataset_kwargs['chain_sum']" in message and "task.eval_modulus" in message
    other = next(s for s in range(1, 500) if not _all_eval_only_chain_sum(s))
    task = build_task(TaskConfig(datasets=["chain_sum"], dataset_kwargs=SIZE_ONE, seed=other, num_eval=0))
    assert len({task.train_problem(i).prompt for i in range(5)}) == 1


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_a_small_source_with_few_training_prompts_serves_every_index(tmp_path):
    """200 eval-only prompts and one trainable: 64 hashed draws miss it for about 3 indices in 4, which used
    to raise mid-run; a small finite source is now scanned in full."""
    modulus = 2
    held = [f"q{i}" for i in range(2000) if prompt_bucket(f"q{i}", modulus) == 0][:200]
    trainable = next(f"t{i}" for i in range(100) if prompt_bucket(f"t{i}", modulus) != 0)
    rows = [{"prompt": p, "answer": "1"} for p in held] + [{"prompt": trainable, "answer": "2"}]
    path = _jsonl(tmp_path / "few.jsonl", rows)
    task = build_task(TaskConfig(datasets=[f"jsonl:{path}"], eval_modulus=modulus, num_eval=5))
    assert (1 - 1 / len(rows)) ** MAX_TRAIN_ATTEMPTS > 0.5  # most indices miss it by hashing alone
    assert {task.train_problem(i).prompt for i in range(40)} == {trainable}
    assert trainable not in {p.prompt for p in task.eval_problems()}


@pytest.mark.parametrize("kwargs,needles", [
    ({"size": True}, ["size=True must be a positive integer"]),
    ({"min_terms": "2"}, ['min_terms="2" is a JSON string', "expects a number", '{"min_terms": 2}']),
    ({"allow_negation": "no"}, ['allow_negation="no"', "expects true or false"]),
    ({"min_termz": 2}, ["'min_termz' is not a field", "did you mean 'min_terms'?"]),
])
def test_dataset_kwargs_of_the_wrong_type_or_name_are_refused(kwargs, needles):
    with pytest.raises(ValueError) as info:
        build_task(TaskConfig(datasets=["chain_sum"], dataset_kwargs={"chain_sum": kwargs}, num_eval=0))
    message = str(info.value)
    assert "task.dataset_kwargs['chain_sum']" in message
    for needle in needles:
        assert needle in message, message


def test_composite_is_refused_with_the_native_mixture_as_the_fix():
    with pytest.raises(ValueError, match=r"'composite'.*task\.datasets=chain_sum,gcd task\.weights=2,1"):
        build_task(TaskConfig(datasets=["composite"], num_eval=0))


def test_jsonl_repeated_key_in_one_object_is_refused(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4", "prompt": "3+3?"}\n',
                    encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{path}:2: key 'prompt' appears twice"):
        build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=0))


def test_jsonl_directory_is_named_as_a_directory(tmp_path):
    with pytest.raises(IsADirectoryError, match=rf"^{tmp_path}: is a directory, not a JSONL problem file"):
        build_task(TaskConfig(datasets=[f"jsonl:{tmp_path}"], num_eval=0))


def test_cli_refuses_a_source_without_training_prompts_before_building_the_model(tmp_path):
    seed = next(s for s in range(1, 500) if _all_eval_only_chain_sum(s))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["-m", "megatron_logra.cli", "train", "tiny", "task.datasets=chain_sum",
            f"task.dataset_kwargs={json.dumps(SIZE_ONE)}", f"task.seed={seed}", f"train.run_dir={tmp_path / 'run'}",
            "rl.steps=1"]
    if forked.usable():  # its own process, forked warm: none of a cold interpreter's imports
        proc = forked.run_python(argv, env=env, cwd=tmp_path, timeout=120)
    else:
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "megatron-logra: error: task.datasets: 'chain_sum' has no training prompts" in proc.stderr
    assert "Traceback" not in proc.stderr and "embedded engine" not in proc.stderr


def test_train_stream_and_eval_set_are_the_same_in_another_process(tmp_path):
    """Same seed, same problems, whatever the process's PYTHONHASHSEED (stable hashing throughout)."""
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {i}+{i}?", "answer": 2 * i} for i in range(64)])
    code = ("import json, sys\nfrom megatron_logra.rewards import TaskConfig, build_task\n"
            f"t = build_task(TaskConfig(datasets=['chain_sum', 'jsonl:{path}'], weights=[1, 1], num_eval=12))\n"
            "json.dump([[t.train_problem(i).prompt for i in range(40)], [p.prompt for p in t.eval_problems()]], "
            "sys.stdout)\n")
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1]
    train, held = outs[0]
    assert len(held) == 12 and not set(train) & set(held)

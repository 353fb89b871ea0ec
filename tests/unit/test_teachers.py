"""Warm-start teachers: the careless teacher's slip on real reasoning-gym chain_sum items."""

import pytest

from megatron_logra.rewards import TaskConfig, build_task
from megatron_logra.rl.config import SFTConfig
from megatron_logra.rl.teachers import build_teacher, evaluate_chain


def _naive_eval(expression: str, minus_as_plus: bool) -> int:
    tokens = expression.split()
    total, sign = 0, 1
    for tok in tokens:
        if tok in "+-":
            sign = -1 if (tok == "-" and not minus_as_plus) else 1
        else:
            total += sign * int(tok)
    return total


def test_evaluate_chain_matches_python_eval_on_real_items():
    task = build_task(TaskConfig(datasets=["chain_sum"], num_eval=10,
                                 dataset_kwargs={"chain_sum": {"min_terms": 2, "max_terms": 4, "max_digits": 2}}))
    for i in range(50):
        problem = task.train_problem(i)
        expr = problem.metadata["expression"]
        assert evaluate_chain(expr) == int(problem.answer) == eval(expr)  # noqa: S307 - trusted test data
        assert evaluate_chain(expr, minus_as_plus=True) == _naive_eval(expr, True)
    assert evaluate_chain("3 * 4") is None
    assert evaluate_chain("import os") is None


def test_careless_teacher_slips_at_the_configured_rate():
    task = build_task(TaskConfig(datasets=["chain_sum"], num_eval=10,
                                 dataset_kwargs={"chain_sum": {"min_terms": 3, "max_terms": 3, "max_digits": 1}}))
    teacher = build_teacher("careless_arithmetic", {"slip_rate": 0.6, "slip": "minus_as_plus"})
    slipped = considered = 0
    for i in range(600):
        problem = task.train_problem(i)
        expr = problem.metadata["expression"]
        answer = teacher(problem, i)
        wrong = str(_naive_eval(expr, True))
        assert answer in (problem.answer, wrong)
        if "-" in expr and wrong != problem.answer:
            considered += 1
            slipped += answer == wrong
    assert considered > 200
    assert 0.5 < slipped / considered < 0.7
    reference = build_teacher("reference")
    assert all(reference(task.train_problem(i), i) == task.train_problem(i).answer for i in range(20))
    # the choice is a pure function of the index: the same demonstration every time
    assert [teacher(task.train_problem(i), i) for i in range(30)] == [teacher(task.train_problem(i), i) for i in range(30)]


def test_teacher_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown sft.teacher"):
        build_teacher("sloppy")
    with pytest.raises(ValueError, match="cannot be imported"):
        build_teacher("no_such_module_xyz:factory")
    with pytest.raises(ValueError, match="slip_rate"):
        build_teacher("careless_arithmetic", {"slip_rate": 1.5})
    with pytest.raises(ValueError, match="teacher_kwargs"):
        build_teacher("careless_arithmetic", {"rate": 0.5})
    with pytest.raises(ValueError, match="slip="):
        build_teacher("careless_arithmetic", {"slip": "typo"})
    with pytest.raises(ValueError, match="final_lr_ratio"):
        SFTConfig(final_lr_ratio=2.0)


def test_drop_tens_teacher_on_basic_arithmetic_items():
    task = build_task(TaskConfig(datasets=["basic_arithmetic"], num_eval=10, dataset_kwargs={"basic_arithmetic": {
        "min_terms": 2, "max_terms": 3, "max_digits": 1, "operators": ["+"], "allow_parentheses": False,
        "allow_negation": False}}))
    always = build_teacher("megatron_logra.rl.teachers:careless_arithmetic", {"slip_rate": 1.0, "slip": "drop_tens"})
    carries = 0
    for i in range(100):
        problem = task.train_problem(i)
        value = sum(int(t) for t in problem.metadata["expression"].split("+"))
        assert int(problem.answer) == value
        assert always(problem, i) == str(value % 10)
        carries += value >= 10
    assert carries > 20


def test_echo_equals_slip_is_rejected_by_the_real_scorer():
    task = build_task(TaskConfig(datasets=["chain_sum"], num_eval=10,
                                 dataset_kwargs={"chain_sum": {"min_terms": 2, "max_terms": 3, "max_digits": 1}}))
    teacher = build_teacher("careless_arithmetic", {"slip_rate": 0.6, "slip": "echo_equals"})
    answers = [(task.train_problem(i), teacher(task.train_problem(i), i)) for i in range(300)]
    slipped = [(p, a) for p, a in answers if a != p.answer]
    assert 0.5 < len(slipped) / len(answers) < 0.7
    for problem, answer in slipped:
        assert answer == "= " + problem.answer
        assert task.score(problem, answer)[1] is False
        assert task.score(problem, problem.answer)[1] is True

"""Tasks and rewards (megatron_logra.rewards) on real reasoning-gym items and real math-verify."""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_logra.rewards import (
    MathVerifyScorer,
    Problem,
    TaskConfig,
    build_task,
    extract_final_answer,
    load_jsonl_problems,
    load_reward_fn,
    math_equal,
    prompt_bucket,
)
from megatron_logra.rewards.math import MAX_ANSWER_CHARS

TINY_SUM = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
SHORT_TASKS = [
    "chain_sum", "basic_arithmetic", "products", "simple_equations", "gcd", "lcm", "count_bits",
    "letter_counting", "leg_counting", "spell_backward", "base_conversion",
]


@pytest.fixture(scope="module")
def tiny_task():
    return build_task(TaskConfig(datasets=["chain_sum"], dataset_kwargs=TINY_SUM, num_eval=200, seed=5))


@pytest.fixture(scope="module")
def mix_task():
    cfg = TaskConfig(datasets=["chain_sum", "products", "gcd"], weights=[0.6, 0.3, 0.1], num_eval=30, seed=11)
    return build_task(cfg)


# --------------------------------------------------------------------------- reasoning-gym scoring
@pytest.mark.parametrize("name", SHORT_TASKS)
def test_gym_scorer_own_answer_is_correct_and_wrong_is_not(name):
    import reasoning_gym

    from megatron_logra.rewards.gym import GymScorer, GymSource

    source = GymSource(name, seed=3)
    scorer = GymScorer(source.dataset, name)
    reference = reasoning_gym.create_dataset(name, seed=3, size=10)  # reasoning-gym's own items
    for i in range(3):
        problem = source.problem(i)
        assert problem.source == name
        assert (problem.prompt, problem.answer) == (reference[i]["question"], reference[i]["answer"])
        assert scorer.score(problem, problem.answer) == 1.0
        assert scorer.score(problem, f"Let me think.\n<answer>{problem.answer}</answer>") == 1.0
        assert scorer.score(problem, "zzz not it") < 1.0
        assert scorer.score(problem, "") < 1.0


def test_task_reward_values(tiny_task):
    p = tiny_task.train_problem(0)
    assert tiny_task.score(p, p.answer) == (1.0, True)
    assert tiny_task.score(p, "no idea") == (-0.01, False)
    # graded reasoning-gym scores interpolate: reference computed with reasoning-gym's scorer itself
    import reasoning_gym

    near_miss = "9" + p.answer
    entry = {"question": p.prompt, "answer": p.answer, "metadata": p.metadata}
    s = reasoning_gym.create_dataset("chain_sum", **TINY_SUM["chain_sum"]).score_answer(near_miss, entry)
    assert 0 < s < 1
    reward, correct = tiny_task.score(p, near_miss)
    assert not correct and reward == pytest.approx(-0.01 + s * 1.01)
    custom = build_task(TaskConfig(dataset_kwargs=TINY_SUM, correct_reward=2.0, wrong_reward=-1.0, num_eval=0))
    q = custom.train_problem(7)
    assert custom.score(q, q.answer) == (2.0, True)
    assert custom.score(q, "x") == (-1.0, False)
    assert custom.score(q, "9" + q.answer)[0] > -1.0  # graded by default
    binary = build_task(TaskConfig(dataset_kwargs=TINY_SUM, graded=False, num_eval=0))
    assert binary.score(p, near_miss) == (-0.01, False)
    assert binary.score(p, p.answer) == (1.0, True)
    with pytest.raises(ValueError, match="not one of this task's sources"):
        tiny_task.score(Problem("q", "1", "products", {}), "1")


# --------------------------------------------------------------------------- sampling
def test_mixture_weights_respected(mix_task):
    n = 6000
    counts = Counter(mix_task.train_problem(i).source for i in range(n))
    # The source of index i is a deterministic hash-uniform, i.e. i.i.d. draws: each count is
    # Binomial(n, p); a 5-sigma bound fails by chance with probability < 1e-6 per source.
    for name, p in zip(["chain_sum", "products", "gcd"], [0.6, 0.3, 0.1]):
        assert abs(counts[name] - n * p) <= 5 * math.sqrt(n * p * (1 - p)), counts
    zero = build_task(TaskConfig(datasets=["chain_sum", "gcd"], weights=[1.0, 0.0], num_eval=0))
    assert {zero.train_problem(i).source for i in range(500)} == {"chain_sum"}


def test_determinism_by_index(mix_task):
    again = build_task(TaskConfig(datasets=["chain_sum", "products", "gcd"], weights=[0.6, 0.3, 0.1], num_eval=30, seed=11))
    indices = [0, 1, 17, 999, 123_456, 10**9]
    forward = [mix_task.train_problem(i) for i in indices]
    backward = [again.train_problem(i) for i in reversed(indices)][::-1]
    assert [(p.prompt, p.answer, p.source, p.metadata) for p in forward] == [
        (p.prompt, p.answer, p.source, p.metadata) for p in backward
    ]
    assert [p.prompt for p in mix_task.eval_problems()] == [p.prompt for p in again.eval_problems()]
    other_seed = build_task(TaskConfig(datasets=["chain_sum", "products", "gcd"], weights=[0.6, 0.3, 0.1], num_eval=30, seed=12))
    differ = sum(mix_task.train_problem(i).prompt != other_seed.train_problem(i).prompt for i in range(50))
    assert differ >= 40
    # the eval set depends on eval_seed only, so runs with different seeds share it
    assert [p.prompt for p in other_seed.eval_problems()] == [p.prompt for p in mix_task.eval_problems()]
    with pytest.raises(ValueError, match="train index"):
        mix_task.train_problem(-1)


# --------------------------------------------------------------------------- train/eval disjointness
def test_eval_disjoint_from_train_in_tiny_prompt_space(tiny_task):
    import reasoning_gym

    evals = tiny_task.eval_problems()
    eval_prompts = {p.prompt for p in evals}
    assert len(evals) == len(eval_prompts) > 0
    train = {tiny_task.train_problem(i).prompt for i in range(5000)}
    assert not train & eval_prompts
    # the raw generator does produce the eval prompts: the partition, not luck, keeps them out
    raw = reasoning_gym.create_dataset("chain_sum", seed=5, size=10**6, **TINY_SUM["chain_sum"])
    space = {raw[i]["question"] for i in range(5000)}
    assert eval_prompts <= space
    held_out = {q for q in space if prompt_bucket(q, tiny_task.eval_modulus) == 0}
    assert eval_prompts == held_out  # every eval-only prompt of the space is found
    assert train == space - held_out  # and training covers the rest of the space


def test_eval_disjoint_and_sized_in_large_space(mix_task):
    evals = mix_task.eval_problems()
    assert len(evals) == 30 and len({p.prompt for p in evals}) == 30
    assert Counter(p.source for p in evals) == {"chain_sum": 18, "products": 9, "gcd": 3}
    assert all(mix_task.is_eval_prompt(p.prompt) for p in evals)
    train = {mix_task.train_problem(i).prompt for i in range(5000)}
    assert not train & {p.prompt for p in evals}
    assert not any(mix_task.is_eval_prompt(q) for q in train)
    assert len(train) > 4500  # a large space: the stream rarely repeats


# --------------------------------------------------------------------------- math-verify
@pytest.mark.parametrize("completion", ["\\boxed{1/2}", "The answer is 0.5", "so $\\boxed{\\frac{1}{2}}$."])
def test_math_verify_equivalent_forms(completion):
    problem = Problem("What is 1/2?", "\\frac{1}{2}", "jsonl:x", {})
    assert MathVerifyScorer().score(problem, completion) == 1.0


def test_math_verify_non_equivalence_and_threads():
    assert math_equal("0.5", "\\frac{1}{2}") and math_equal("\\frac{1}{2}", "1/2")
    assert not math_equal("\\frac{1}{2}", "\\frac{1}{3}")
    assert not math_equal("\\frac{1}{2}", "0.6")
    problem = Problem("?", "\\frac{1}{2}", "jsonl:x", {})
    scorer = MathVerifyScorer()
    with ThreadPoolExecutor(2) as pool:  # math-verify's signal timeouts would raise off the main thread
        results = list(pool.map(lambda c: scorer.score(problem, c), ["\\boxed{0.5}", "\\boxed{2}", "no answer"]))
    assert results == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("x \\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # last boxed, nested braces
        ("<answer>3</answer> but \\boxed{4}", "4"),  # boxed beats the answer tag
        ("<answer> 7 </answer> and 9 more", "7"),  # answer tag beats numbers
        ("<answer>\\boxed{5}</answer>", "5"),
        ("So the answer is 42. Done", "42"),
        ("Answer:\n  $x = 3$\n", "x = 3"),  # next non-empty line, $ removed
        ("final answer: 12.", "12"),
        ("we get 1,234 then 17", "17"),  # last number
        ("total 1,234", "1,234"),
        ("it is -5", "-5"),
        ("5-3", "3"),  # a minus after a digit is subtraction, not a sign
        ("ratio 3/4", "3/4"),
        ("no digits here", None),
        ("\\boxed{unclosed", None),
        ("\\boxed{" + "1" * (MAX_ANSWER_CHARS + 1) + "}", None),
        # Markdown emphasis and code marks around a marked answer are not part of it
        ("The final answer is **42**.", "42"),
        ("Answer: **42**", "42"),
        ("So the answer is *42*.", "42"),
        ("The answer is `42`.", "42"),
        ("The answer is __42__.", "42"),
        ("**Answer:** 42", "42"),
        # <answer> content: the marker / last-number rules apply to prose, other content is the answer
        ("<answer> The total is 42 </answer>", "42"),
        ("<answer>The answer is 42.</answer>", "42"),
        ("<answer>**42**</answer>", "42"),
        ("<answer>Evelyn</answer>", "Evelyn"),
        ("<answer>x = 3</answer>", "x = 3"),
        ("<answer>\\sqrt{2} + \\pi</answer>", "\\sqrt{2} + \\pi"),
    ],
)
def test_answer_extraction_rules(completion, expected):
    assert extract_final_answer(completion) == expected


RIGHT_42 = ["The final answer is **42**.", "Answer: **42**", "So the answer is *42*.", "The answer is `42`.",
            "<answer> The total is 42 </answer>", "<answer>We get 40 + 2 = 42</answer>"]


@pytest.mark.parametrize("completion", RIGHT_42 + [c.replace("42", "41") for c in RIGHT_42]
                         + ["<answer>The total is 42, no wait, 41</answer>", "**41**"])
def test_math_verify_scores_emphasised_and_prose_answers(completion):
    problem = Problem("What is 6 * 7?", "42", "jsonl:x", {})
    expected = 1.0 if completion in RIGHT_42 else 0.0
    assert MathVerifyScorer().score(problem, completion) == expected


def test_math_equal_parses_unwrapped_when_the_boxed_parse_is_only_text():
    # "\\boxed{**42**}" parses to the string "**42**" alone; the unwrapped text parses to the number
    assert math_equal("42", "**42**")
    assert not math_equal("42", "**41**")
    assert not math_equal("42", "`41`")


# --------------------------------------------------------------------------- JSONL
def _write(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_jsonl_loading_plain_and_math500_keys(tmp_path):
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "1+1?", "answer": 2, "id": "a"},
        "",
        {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac12}$.", "answer": "\\frac{1}{2}",
         "subject": "Algebra", "level": 2, "unique_id": "test/algebra/1.json"},
        {"question": "Third?", "solution": "so \\boxed{\\frac{1}{3}}", "metadata": {"tag": "x"}},
    ])
    problems = load_jsonl_problems(path)
    assert [p.prompt for p in problems] == ["1+1?", "Half of one?", "Third?"]
    assert [p.answer for p in problems] == ["2", "\\frac{1}{2}", "\\frac{1}{3}"]
    assert {p.source for p in problems} == {f"jsonl:{path}"}
    assert problems[0].metadata["id"] == "a"
    assert problems[1].metadata["id"] == "test/algebra/1.json" and problems[1].metadata["subject"] == "Algebra"
    assert problems[1].metadata["line"] == 3 and problems[2].metadata["tag"] == "x"


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"prompt": "q"}), "missing 'answer'"),
        (json.dumps({"answer": "1"}), "missing 'prompt'"),
        (json.dumps(["prompt", "answer"]), "expected a JSON object"),
        (json.dumps({"problem": "q", "solution": "no box"}), "boxed"),
        (json.dumps({"prompt": "q", "answer": "1", "metadata": 3}), "'metadata' must be"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, bad_line])
    with pytest.raises(ValueError, match=message) as err:
        load_jsonl_problems(path)
    assert f"{path}:2:" in str(err.value)


def test_jsonl_missing_and_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl_problems(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no problems"):
        load_jsonl_problems(tmp_path / "empty.jsonl")


def test_jsonl_task_split_and_math_verify_scoring(tmp_path):
    rows = [{"prompt": f"What is {i} halves?", "answer": f"\\frac{{{i}}}{{2}}"} for i in range(1, 81)]
    path = _write(tmp_path / "halves.jsonl", rows)
    task = build_task(TaskConfig(datasets=[f"jsonl:{path}"], num_eval=500, eval_modulus=4))
    evals = task.eval_problems()
    expected_eval = {r["prompt"] for r in rows if prompt_bucket(r["prompt"], 4) == 0}
    assert {p.prompt for p in evals} == expected_eval and 0 < len(evals) < 80
    train = {task.train_problem(i).prompt for i in range(1000)}
    assert train == {r["prompt"] for r in rows} - expected_eval
    p = evals[0]
    value = int(p.prompt.split()[2]) / 2  # "What is {i} halves?" -> i / 2, as a decimal
    assert task.score(p, f"I think the result is \\boxed{{{value}}}") == (1.0, True)
    assert task.score(p, f"\\boxed{{{value + 1}}}") == (-0.01, False)


# --------------------------------------------------------------------------- plugins
PLUGIN_SOURCE = '''
def exact(problem, completion):
    return 1.0 if completion.strip() == problem.answer else 0.0

def half(problem, completion):
    return 0.5

def too_big(problem, completion):
    return 2.0

def says_yes(problem, completion):
    return "yes"

def one_arg(problem):
    return 1.0

VALUE = 3
'''


@pytest.fixture()
def plugin_module(tmp_path, monkeypatch):
    name = f"mlogra_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN_SOURCE)
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_plugin_reward_by_dotted_path(plugin_module):
    for path in (f"{plugin_module}:exact", f"{plugin_module}.exact"):
        task = build_task(TaskConfig(dataset_kwargs=TINY_SUM, reward=path, num_eval=0))
        p = task.train_problem(3)
        assert task.score(p, f" {p.answer} ") == (1.0, True)
        assert task.score(p, p.answer + "0") == (-0.01, False)
    half = build_task(TaskConfig(dataset_kwargs=TINY_SUM, reward=f"{plugin_module}:half", num_eval=0))
    reward, correct = half.score(half.train_problem(0), "anything")
    assert not correct and reward == pytest.approx(-0.01 + 0.5 * 1.01)
    with pytest.raises(ValueError, match=rf"{plugin_module}:too_big.*2\.0"):
        build_task(TaskConfig(dataset_kwargs=TINY_SUM, reward=f"{plugin_module}:too_big", num_eval=0)).score(
            half.train_problem(0), "x")


@pytest.mark.parametrize(
    "suffix, message",
    [
        (":nope", "has no attribute 'nope'.*exact"),
        (":VALUE", "not a function"),
        (":one_arg", r"\(problem, completion\)"),
        ("_broken:fn", "RuntimeError: boom at import"),
    ],
)
def test_plugin_errors_name_path_and_problem(plugin_module, suffix, message):
    path = plugin_module + suffix
    with pytest.raises(ValueError, match=message) as err:
        load_reward_fn(path)
    assert path in str(err.value)


def test_plugin_path_errors(plugin_module):
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz.mod'"):
        load_reward_fn("no_such_pkg_xyz.mod:fn")
    with pytest.raises(ValueError, match="package.module:function"):
        load_reward_fn("not-a-path")
    scorer_fn = load_reward_fn(f"{plugin_module}:says_yes")
    from megatron_logra.rewards.plugins import PluginScorer

    with pytest.raises(ValueError, match="returned 'yes'"):
        PluginScorer(f"{plugin_module}:says_yes").score(Problem("q", "1", "s", {}), "1")
    assert scorer_fn(None, "") == "yes"


# --------------------------------------------------------------------------- configuration
def test_unknown_dataset_name_lists_valid_names():
    with pytest.raises(ValueError, match="task.datasets") as err:
        build_task(TaskConfig(datasets=["chain_summ"]))
    text = str(err.value)
    assert "'chain_summ'" in text and "chain_sum" in text.replace("'chain_summ'", "") and "gcd" in text
    with pytest.raises(ValueError, match="bogus") as err:
        build_task(TaskConfig(datasets=["chain_sum"], dataset_kwargs={"chain_sum": {"bogus": 1}}))
    assert "min_terms" in str(err.value)


def test_task_config_validation():
    cfg = TaskConfig(datasets="chain_sum, gcd", weights=["1", "3"], dataset_kwargs='{"gcd": {"min_numbers": 2}}')
    assert cfg.datasets == ["chain_sum", "gcd"] and cfg.weights == [1.0, 3.0]
    assert cfg.dataset_kwargs == {"gcd": {"min_numbers": 2}} and cfg.normalized_weights == [0.25, 0.75]
    bad = [
        (dict(datasets=[]), "task.datasets"),
        (dict(datasets=["Chain Sum"]), r"task.datasets\[0\]"),
        (dict(datasets=["gcd", "gcd"]), "more than once"),
        (dict(datasets=["jsonl:"]), "jsonl"),
        (dict(datasets=["gcd", "lcm"], weights=[1.0]), "task.weights"),
        (dict(weights=[-1.0]), "task.weights"),
        (dict(weights=["a"]), "task.weights"),
        (dict(dataset_kwargs={"gcd": {}}), r"task.dataset_kwargs\['gcd'\]"),
        (dict(reward="exact match"), "task.reward"),
        (dict(correct_reward=0.0, wrong_reward=0.0), "task.correct_reward"),
        (dict(num_eval=-1), "task.num_eval"),
        (dict(eval_modulus=1), "task.eval_modulus"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            TaskConfig(**kwargs)

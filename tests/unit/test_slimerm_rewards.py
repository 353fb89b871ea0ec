"""``task.reward=slime:package.module:function``: a reward function written for slime's ``--custom-rm-path``
(``[async] def rm(args, sample) -> float``) scores a JSONL task unchanged; its float is the reward (1 / 0, -1 / 1, any
scale) and a reward >= ``task.correct_reward`` is correct; the sample and ``args`` hold what slime's would; bad
specs and bad return values are clear errors naming the function.

Real slime-style reward modules written into ``tmp_path``, real JSONL tasks, the RL step's own scoring; no mocks.
"""

from __future__ import annotations

import json
import uuid

import pytest

from megatron_logra.rewards import TaskConfig, build_task
from megatron_logra.rl.step_guard import RewardError, score_rollouts

SLIME_RM = '''
import asyncio

SEEN = []


async def exact(args, sample):
    """slime's usual shape: 1 when the response is the label, else 0."""
    await asyncio.sleep(0)
    return 1.0 if sample.response.strip() == sample.label else 0.0


def signed(args, sample):
    """A plain def of a -1 / 1 reward (as DAPO's)."""
    return 1 if sample.response.strip() == sample.label else -1


async def by_metadata(args, sample):
    """A mixture's reward: reads the sample's metadata and args, and records what it saw."""
    SEEN.append(dict(source=sample.metadata["source"], difficulty=sample.metadata.get("difficulty"),
                     n=args.n_samples_per_prompt, max_len=args.rollout_max_response_len, label_key=args.label_key,
                     rm_path=args.custom_rm_path, prompt=sample.prompt, index=sample.index,
                     status=sample.status.value, reward=sample.reward))
    sample.metadata["difficulty"] = "changed"  # a function that changes its sample changes no other
    bonus = 0.5 if SEEN[-1]["difficulty"] == "hard" else 0.0
    return 1.0 + bonus if sample.response.strip() == sample.label else 0.0


async def returns(args, sample):
    """Returns the value the completion spells (nan, '1', None, [1.0, 0.0], ...)."""
    return eval(sample.response)


async def iterates(args, samples):
    """Written for slime's --group-rm: iterates over its samples."""
    return [1.0 if s.response == s.label else 0.0 for s in samples]


async def annotated(args, samples: "list[Sample]") -> "list[float]":
    return [1.0] * len(samples)


def token_count(args, sample):
    return float(sample.response_length < 10)


def one_argument(sample):
    return 1.0
'''

ROWS = [
    {"prompt": "2+2=", "label": "4", "metadata": {"difficulty": "easy"}},
    {"prompt": "3*3=", "label": "9", "metadata": {"difficulty": "hard"}},
    {"prompt": "7-5=", "label": "2"},
    {"prompt": "10/2=", "label": "5", "metadata": {"difficulty": "hard"}},
]


@pytest.fixture
def slime_module(tmp_path, monkeypatch):
    """``(module name, jsonl file)``: the slime-style reward module, importable, and a file of :data:`ROWS`."""
    name = f"mlogra_slimerm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SLIME_RM)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return name, data


def _task(slime_module, fn: str, **kwargs):
    name, data = slime_module
    return build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=f"slime:{name}:{fn}", num_eval=0, **kwargs))


def _problems(task):
    (source,) = task.sources
    return list(source.problems)


def test_an_async_slime_function_rewards_a_jsonl_batch(slime_module):
    task = _task(slime_module, "exact")
    problems = _problems(task)
    completions = [p.answer if i % 2 == 0 else p.answer + "0" for i, p in enumerate(problems)]
    assert score_rollouts(task, problems, completions, step=1) == [(1.0, True), (0.0, False)] * 2
    # slime's own spelling of the path (--custom-rm-path package.module.function) is the same function
    name, data = slime_module
    dotted = build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=f"slime:{name}.exact", num_eval=0))
    assert score_rollouts(dotted, problems, completions, step=1) == [(1.0, True), (0.0, False)] * 2
    # a plugin's rows are kept whatever their answers: every row is scored
    assert [p.answer for p in problems] == [r["label"] for r in ROWS]


def test_the_float_is_the_reward_and_correct_is_at_least_the_correct_reward(slime_module):
    # -1 / 1 from a plain def: the rewards as slime gives them; wrong_reward and graded do not apply
    task = _task(slime_module, "signed", wrong_reward=-0.2, graded=False)
    problems = _problems(task)
    completions = [p.answer if i < 2 else "no" for i, p in enumerate(problems)]
    assert score_rollouts(task, problems, completions, step=1) == [(1.0, True)] * 2 + [(-1.0, False)] * 2
    # the correct reward is the threshold of a correct answer: above the function's 1, nothing is correct
    high = _task(slime_module, "signed", correct_reward=2.0)
    assert score_rollouts(high, problems, completions, step=1) == [(1.0, False)] * 2 + [(-1.0, False)] * 2
    low = _task(slime_module, "signed", correct_reward=-1.0, wrong_reward=-5.0)
    assert [c for _, c in score_rollouts(low, problems, completions, step=1)] == [True] * 4


def test_the_sample_and_args_hold_what_slimes_would(slime_module):
    import importlib

    from megatron_logra.config import parse_args_to_config
    from megatron_logra.rewards.slime_rm import RUN_ARGS_ATTR, with_run_args

    name, data = slime_module
    cfg = parse_args_to_config("tiny", [f"task.datasets=jsonl:{data}", f"task.reward=slime:{name}.by_metadata",
                                        "task.jsonl_answer_key=label", "rl.group_size=3", "task.num_eval=0",
                                        "rl.rollout.max_new_tokens=7"])
    task = build_task(with_run_args(cfg.task, cfg.rl))  # as the RL job builds it (rl/task_setup.py)
    assert not hasattr(cfg.task, RUN_ARGS_ATTR)  # the user's config is left as it is
    problems = _problems(task)
    seen = importlib.import_module(name).SEEN
    seen.clear()
    scored = score_rollouts(task, problems + problems[:2], [p.answer for p in problems] + ["x", "x"], step=1)
    assert scored == [(1.0, True), (1.5, True), (1.0, True), (1.5, True), (0.0, False), (0.0, False)]
    assert [s["difficulty"] for s in seen] == ["easy", "hard", None, "hard", "easy", "hard"]
    assert {s["source"] for s in seen} == {f"jsonl:{data}"}
    assert {(s["n"], s["max_len"], s["label_key"], s["rm_path"]) for s in seen} == {(3, 7, "label", f"{name}.by_metadata")}
    assert [s["prompt"] for s in seen[:4]] == [r["prompt"] for r in ROWS]
    assert {(s["index"], s["status"], s["reward"]) for s in seen} == {(None, "completed", None)}
    assert problems[0].metadata["difficulty"] == "easy"
    # a task built on its own (no RL job) has no rl fields: the error names where they come from
    with pytest.raises(RewardError, match=r"args.n_samples_per_prompt .*rl.group_size"):
        score_rollouts(build_task(cfg.task), problems[:1], ["4"], step=2)


@pytest.mark.parametrize("spec, fix", [
    ("slime:", "slime:package.module:function"),
    ("slime:rewards", "slime:package.module:function"),
    ("slime:my rewards.rm", "slime:package.module:function"),
    ("slime:a.b:c:d", "--custom-rm-path"),
    ("slime:a.b.", "Python identifiers"),
])
def test_a_malformed_slime_spec_is_refused_naming_the_field(spec, fix):
    with pytest.raises(ValueError, match=r"task\.reward=") as err:
        TaskConfig(reward=spec)
    assert repr(spec) in str(err.value) and fix in str(err.value)


def test_a_function_that_cannot_be_loaded_is_refused_at_build(slime_module):
    name, data = slime_module
    cases = {"slime:mlogra_no_such_module_slimerm.rm": "cannot import module 'mlogra_no_such_module_slimerm'",
             f"slime:{name}:missing": "has no attribute 'missing'",
             f"slime:{name}.one_argument": "must accept (args, sample) positionally",
             f"slime:{name}:annotated": "--group-rm"}
    for spec, what in cases.items():
        with pytest.raises(ValueError) as err:
            build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=spec, num_eval=0))
        assert spec in str(err.value) and what in str(err.value), str(err.value)


@pytest.mark.parametrize("spelled, what", [
    ("float('nan')", "returned nan; expected a finite number (the reward)"),
    ("float('-inf')", "returned -inf; expected a finite number"),
    ("'1'", "returned '1' (str); expected a finite number"),
    ("None", "returned None (NoneType)"),
    ("10**400", "an integer of about 401 digits"),
    ("[1.0, 0.0]", "returned a list of 2 values; expected one reward (a number) per call: a function written for "
                   "slime's --group-rm"),
    ("{'acc': 1.0}", "returned a dict (keys ['acc']); slime's --reward-key is not supported"),
])
def test_a_bad_return_value_is_a_clear_error(slime_module, spelled, what):
    task = _task(slime_module, "returns")
    problem = _problems(task)[0]
    with pytest.raises(RewardError) as err:
        score_rollouts(task, [problem], [spelled], step=4)
    message = str(err.value)
    assert message.startswith("RL step 4: the reward of sample 0") and what in message, message
    assert f"slime:{slime_module[0]}:returns" in message
    # numbers of other types are rewards as they are
    assert score_rollouts(task, [problem], ["True"], step=5) == [(1.0, True)]
    assert score_rollouts(task, [problem], ["__import__('fractions').Fraction(-3, 4)"], step=5) == [(-0.75, False)]


def test_a_group_rm_function_and_token_fields_are_refused_clearly(slime_module):
    name, _ = slime_module
    problem = _problems(_task(slime_module, "exact"))[0]
    with pytest.raises(RewardError, match=rf"slime:{name}:iterates.*not a list.*--group-rm"):
        score_rollouts(_task(slime_module, "iterates"), [problem], ["4"], step=1)
    with pytest.raises(RewardError, match=r"sample.response_length: token-level fields .* not available"):
        score_rollouts(_task(slime_module, "token_count"), [problem], ["4"], step=1)

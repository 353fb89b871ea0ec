"""``task.reward_timeout_s``: a ``task.reward`` plugin that hangs stops the RL step with a ``RewardError`` naming
the step, the sample and the field, instead of hanging the run (and every other rank in the next collective).

Real plugins written into ``tmp_path`` and imported by dotted path, real tasks, real threads; no mocks.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from megatron_logra.rewards import PluginScorer, RewardTimeout, TaskConfig, build_task
from megatron_logra.rl.step_guard import RewardError, score_rollouts
from support.threads import in_thread

TINY_SUM = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}

PLUGIN = '''
import threading
import time

THREADS = []


def hangs_on_hang(problem, completion):
    """Hangs (30 s, far past the test's limit) on the completion "hang"; exact match otherwise."""
    if completion == "hang":
        time.sleep(30)
    return 1.0 if completion.strip() == problem.answer else 0.0


def exact(problem, completion):
    THREADS.append(threading.current_thread())
    return 1.0 if completion.strip() == problem.answer else 0.5 if problem.answer in completion else 0.0


def raises(problem, completion):
    raise KeyError("no such field")


def math_verify_defaults(problem, completion):
    from math_verify import parse  # its default parsing_timeout uses signal.alarm: main thread only

    return 1.0 if parse("$" + completion + "$") else 0.0


def rewraps(problem, completion):
    """Hangs on "hang" and turns whatever interrupts it into an error of its own."""
    try:
        if completion == "hang":
            time.sleep(30)
        return 1.0
    except BaseException as exc:
        raise RuntimeError("sandbox failed") from exc


def swallows(problem, completion):
    """Hangs on "hang" inside a catch-all, as a reward function that scores any error as wrong does."""
    try:
        if completion == "hang":
            while True:
                time.sleep(0.05)
        return 1.0
    except Exception:
        return 0.0
'''


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    name = f"mlogra_timeout_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _task(reward: str, timeout_s: float):
    return build_task(TaskConfig(dataset_kwargs=TINY_SUM, reward=reward, num_eval=0, reward_timeout_s=timeout_s))


def test_a_hung_plugin_stops_the_step_naming_step_sample_and_field(plugin):
    task = _task(f"{plugin}:hangs_on_hang", 0.3)
    problems = [task.train_problem(i) for i in range(3)]
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        score_rollouts(task, problems, [problems[0].answer, "hang", "x"], step=7)
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert message.startswith("RL step 7: the reward of sample 1 (source 'chain_sum'")
    assert "RewardTimeout" in message and "task.reward_timeout_s=0.3" in message
    assert f"{plugin}:hangs_on_hang" in message
    assert isinstance(err.value.__cause__, RewardTimeout) and isinstance(err.value.__cause__, TimeoutError)
    # the hung call is abandoned: the next step is not queued behind it
    start = time.monotonic()
    scored = score_rollouts(task, problems, [p.answer for p in problems], step=8)
    assert time.monotonic() - start < 2 and scored == [(1.0, True)] * 3


def test_a_plugin_within_the_limit_scores_as_without_it_on_the_main_thread(plugin):
    import importlib

    module = importlib.import_module(plugin)
    limited, unlimited = _task(f"{plugin}:exact", 60.0), _task(f"{plugin}:exact", 0)
    problems = [limited.train_problem(i) for i in range(20)]
    completions = [[p.answer, p.answer + "0", "nothing", f" {p.answer} "][i % 4] for i, p in enumerate(problems)]
    module.THREADS.clear()
    with_limit = score_rollouts(limited, problems, completions, step=1)
    assert set(module.THREADS) == {threading.main_thread()}  # where signal.alarm works, as without a limit
    module.THREADS.clear()
    without = score_rollouts(unlimited, problems, completions, step=1)
    assert with_limit == without and {c for _, c in without} == {True, False}
    assert set(module.THREADS) == {threading.main_thread()}
    # off the main thread the function runs on one long-lived daemon worker
    module.THREADS.clear()
    assert in_thread(lambda: score_rollouts(limited, problems, completions, step=1)) == without
    (worker,) = set(module.THREADS)
    assert worker.daemon and worker is not threading.main_thread()


def test_a_catch_all_in_the_plugin_cannot_swallow_the_timeout(plugin):
    task = _task(f"{plugin}:swallows", 0.3)
    problems = [task.train_problem(i) for i in range(2)]
    with pytest.raises(RewardError, match=r"the reward of sample 1 .*RewardTimeout"):
        score_rollouts(task, problems, ["x", "hang"], step=2)
    time.sleep(2.5)  # past the watchdog's repeats: nothing is raised in the main thread after the call ended
    assert score_rollouts(task, problems, ["x", "y"], step=3) == [(1.0, True)] * 2


NESTED = '''
import time

from megatron_logra.rewards import PluginScorer

INNER = []


def quick(problem, completion):
    return 1.0


def calls_a_timed_plugin_then_hangs(problem, completion):
    """A reward that composes another timed plugin, then hangs past its own limit."""
    if not INNER:
        INNER.append(PluginScorer(__name__ + ":quick", timeout_s=30.0))
    INNER[0].score(problem, completion)
    time.sleep(30)
    return 1.0
'''


def test_a_nested_timed_call_keeps_the_outer_limit(tmp_path, monkeypatch):
    # the inner call's end must not disarm the outer call's deadline: the outer call still times out
    name = f"mlogra_nested_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(NESTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = _task(f"{name}:calls_a_timed_plugin_then_hangs", 0.3)
    problem = task.train_problem(0)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"the reward of sample 0 .*RewardTimeout"):
        score_rollouts(task, [problem], ["x"], step=4)
    assert time.monotonic() - start < 5
    assert score_rollouts(_task(f"{name}:quick", 0.3), [problem], ["x"], step=5) == [(1.0, True)]


def test_plugin_errors_keep_their_cause_under_the_limit(plugin):
    task = _task(f"{plugin}:raises", 5.0)
    problem = task.train_problem(0)
    with pytest.raises(RewardError, match=r"RL step 3: the reward of sample 0 .*KeyError: 'no such field'") as err:
        score_rollouts(task, [problem], ["x"], step=3)
    assert isinstance(err.value.__cause__, KeyError)


def test_an_error_the_plugin_raises_past_its_limit_is_the_timeout(plugin):
    task = _task(f"{plugin}:rewraps", 0.3)
    problems = [task.train_problem(i) for i in range(2)]
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"the reward of sample 1 .*RewardTimeout: .*task\.reward_timeout_s=0\.3"):
        score_rollouts(task, problems, ["x", "hang"], step=4)
    assert time.monotonic() - start < 5
    assert score_rollouts(task, problems, ["x", "y"], step=5) == [(1.0, True)] * 2


def test_math_verify_timeouts_work_under_the_limit_on_the_main_thread(plugin):
    path = f"{plugin}:math_verify_defaults"
    assert PluginScorer(path, timeout_s=5.0).score(None, "1") == 1.0  # type: ignore[arg-type]
    # off the main thread signal.alarm is unavailable: the error names both fixes
    with pytest.raises(ValueError, match=r"needs the main thread.*parsing_timeout=None.*task\.reward_timeout_s=0"):
        in_thread(lambda: PluginScorer(path, timeout_s=5.0).score(None, "1"))  # type: ignore[arg-type]
    assert PluginScorer(path, timeout_s=0).score(None, "1") == 1.0  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan, True, "60"])
def test_bad_reward_timeouts_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"task\.reward_timeout_s=.*>= 0.*task\.reward_timeout_s=60 \(0 disables"):
        TaskConfig(reward_timeout_s=value)


def test_reward_timeout_defaults_and_overrides():
    from megatron_logra.config.overrides import apply_overrides
    from megatron_logra.config.recipe_files import load_recipe

    assert TaskConfig().reward_timeout_s == 60.0
    assert TaskConfig(reward_timeout_s=0).reward_timeout_s == 0.0
    assert apply_overrides(load_recipe("tiny"), ["task.reward_timeout_s=2.5"]).task.reward_timeout_s == 2.5
    with pytest.raises(ValueError, match=r"task\.reward_timeout_s"):
        apply_overrides(load_recipe("tiny"), ["task.reward_timeout_s=-3"])


def test_the_process_exits_promptly_with_a_hung_reward_call(tmp_path):
    (tmp_path / "hung_plugin.py").write_text(textwrap.dedent('''
        import time

        def sleeps(problem, completion):
            time.sleep(600)

        def spins(problem, completion):
            while True:
                pass
    '''))
    script = textwrap.dedent('''
        from megatron_logra.rewards import PluginScorer, RewardTimeout
        for name in ("sleeps", "spins"):
            try:
                PluginScorer("hung_plugin:" + name, timeout_s=0.2).score(None, "x")
            except RewardTimeout:
                pass
        print("exiting")
    ''')
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exiting" and time.monotonic() - start < 30


def test_a_copied_scorer_starts_its_own_worker(plugin):
    import copy

    from megatron_logra.rewards import Problem

    problem = Problem("What is 1 + 1?", "2", "s", {})
    scorer = PluginScorer(f"{plugin}:hangs_on_hang", timeout_s=5.0)
    assert in_thread(lambda: scorer.score(problem, "2")) == 1.0
    clone = copy.deepcopy(scorer)
    assert in_thread(lambda: clone.score(problem, "3")) == 0.0
    assert clone._worker is not None and clone._worker is not scorer._worker

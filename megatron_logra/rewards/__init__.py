"""Tasks and rewards for RL: reasoning-gym datasets, math-verify, local JSONL files, reward plugins.

``build_task(TaskConfig(...))`` returns a :class:`Task` with a deterministic infinite train
stream (``train_problem(index)``), a held-out eval set disjoint from it by prompt text
(``eval_problems()``) and ``score(problem, completion) -> (reward, correct)``. See ``task.py``
for the sampling / disjointness contract and ``math.py`` for the answer-extraction rule.

Importing this package is cheap: reasoning-gym and math-verify are imported on first use.
"""

from __future__ import annotations

from megatron_logra.rewards.base import Problem, ProblemSource, Scorer, prompt_bucket
from megatron_logra.rewards.build import build_task
from megatron_logra.rewards.config import TaskConfig
from megatron_logra.rewards.jsonl import JsonlSource, load_jsonl_problems
from megatron_logra.rewards.math import MathVerifyScorer, extract_final_answer, math_equal
from megatron_logra.rewards.plugins import PluginScorer, RewardTimeout, load_reward_fn
from megatron_logra.rewards.task import Task

__all__ = [
    "JsonlSource",
    "MathVerifyScorer",
    "PluginScorer",
    "Problem",
    "ProblemSource",
    "RewardTimeout",
    "Scorer",
    "Task",
    "TaskConfig",
    "build_task",
    "extract_final_answer",
    "load_jsonl_problems",
    "load_reward_fn",
    "math_equal",
    "prompt_bucket",
]

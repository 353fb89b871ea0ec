"""A reward plugin for multi-process tests (``task.reward=support.rank_reward:first_round_uniform_on_rank0``)."""

from __future__ import annotations

import os

_CALLS = {"uniform": 0, "mixed": 0}

UNIFORM_CALLS = 8
"""How many of rank 0's first scores are 0 (its first round of two prompts × group_size 4: two uniform groups)."""


def first_round_uniform_on_rank0(problem, completion) -> float:
    """Rank 0's first :data:`UNIFORM_CALLS` scores are 0; every other score alternates 1, 0, 1, 0, ... per
    process, whatever the text (so every group of an even size is mixed, with half its samples correct)."""
    if os.environ.get("RANK", "0") == "0" and _CALLS["uniform"] < UNIFORM_CALLS:
        _CALLS["uniform"] += 1
        return 0.0
    _CALLS["mixed"] += 1
    return float(_CALLS["mixed"] % 2 == 1)

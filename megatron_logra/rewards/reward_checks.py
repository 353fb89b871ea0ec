"""Checking the reward fields of :class:`~megatron_logra.rewards.config.TaskConfig` (``task.reward``, its rewards,
time limit, worker processes and ``task.reward_group``): kept apart from the config's dataclass so that its field
checks stay readable; every refusal is a ``ValueError`` naming the field and the fix."""

from __future__ import annotations

import logging
from math import isfinite
from typing import TYPE_CHECKING

from megatron_logra.rewards.plugins import SLIME_PREFIX, is_dotted_path, is_slime_path
from megatron_logra.rewards.remote import is_reward_url

if TYPE_CHECKING:
    from megatron_logra.rewards.config import TaskConfig

__all__ = ["check_reward_fields"]

logger = logging.getLogger(__name__)


def check_reward_fields(cfg: TaskConfig) -> None:
    """Refuse a ``task.reward`` that names no scorer, non-finite or inverted rewards, a bad time limit or worker
    count, and a ``task.reward_group`` that is no bool or has no slime reward function to call; the time limit is
    made a float."""
    reward = cfg.reward
    if isinstance(reward, str) and reward.startswith(SLIME_PREFIX) and not is_slime_path(reward):
        raise ValueError(
            f"task.reward={reward!r}: name a slime reward function 'slime:package.module:function' (or in "
            f"--custom-rm-path's spelling 'slime:package.module.function'; Python identifiers), e.g. "
            f"task.reward=slime:my_rewards:rm")
    if not isinstance(reward, str) or not (reward in ("auto", "math_verify") or is_dotted_path(reward)
                                           or is_slime_path(reward) or is_reward_url(reward)):
        raise ValueError(
            f"task.reward={reward!r}: use auto, math_verify, a dotted path 'package.module:function', a slime "
            f"reward function 'slime:package.module:function' or a reward server's http:// URL"
        )
    for name in ("correct_reward", "wrong_reward"):
        if not isfinite(float(getattr(cfg, name))):
            raise ValueError(f"task.{name}={getattr(cfg, name)!r} must be finite")
    if not cfg.correct_reward > cfg.wrong_reward:
        raise ValueError(f"task.correct_reward={cfg.correct_reward} must exceed task.wrong_reward={cfg.wrong_reward}")
    value = cfg.reward_timeout_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not isfinite(value) or value < 0:
        raise ValueError(
            f"task.reward_timeout_s={value!r}: give a finite number of seconds >= 0 that one reward-plugin "
            f"call may take, e.g. task.reward_timeout_s=60 (0 disables the limit)"
        )
    cfg.reward_timeout_s = float(value)
    value = cfg.reward_workers
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"task.reward_workers={value!r}: give a whole number of reward worker processes >= 0, e.g. "
            f"task.reward_workers=4 (0 scores the rewards in the trainer's own process)")
    if not isinstance(cfg.reward_group, bool):
        raise ValueError(f"task.reward_group={cfg.reward_group!r} must be true or false (call the slime reward "
                         f"function once per prompt with the list of its samples, slime's --group-rm)")
    if cfg.reward_group and not is_slime_path(reward):
        raise ValueError(
            f"task.reward_group=true calls a slime reward function with the list of a prompt's samples (slime's "
            f"--group-rm), but task.reward={reward!r} is none: give task.reward=slime:package.module:function "
            f"(--custom-rm-path package.module.function), or task.reward_group=false")

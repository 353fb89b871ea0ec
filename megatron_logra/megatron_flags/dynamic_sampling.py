"""slime's dynamic sampling flags (:data:`~megatron_logra.megatron_flags.slime.SLIME_SAMPLING_FLAGS`) against
``rl.dynamic_sampling_rounds``.

slime's dynamic sampling (``--dynamic-sampling-filter-path``) keeps only the groups its filter passes, drawing
``--over-sampling-batch-size`` prompts at a time until ``--rollout-batch-size`` groups have passed, with no bound on
the draws. Without a filter it still draws ``--over-sampling-batch-size`` prompts (default, and least, the
``--rollout-batch-size``), keeps the first ``--rollout-batch-size`` groups to finish and aborts the others. Here
dynamic sampling is ``rl.dynamic_sampling_rounds=R``: up to ``R`` extra rounds of ``rl.prompts_per_step`` fresh
prompts per step replace the groups whose rewards are all equal, the groups slime's ``check_reward_nonzero_std``
filter drops (:mod:`megatron_logra.rl.rollout_stage`).

Both flags are resolved after every other override, the filter first (:func:`resolve_sampling`), so that the
recipe's and the line's ``rl.dynamic_sampling_rounds``, ``rl.prompts_per_step`` (``--rollout-batch-size``) and
``job`` count wherever they are on the line.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from megatron_logra.megatron_flags.slime import FILTER_ROUNDS, NONZERO_STD_FILTER, SLIME_SAMPLING_FLAGS

if TYPE_CHECKING:
    from megatron_logra.config.field_setter import FieldSetter
    from megatron_logra.config.run import RunConfig

__all__ = ["resolve_sampling", "sampling_order"]

logger = logging.getLogger(__name__)

_FIELD = "rl.dynamic_sampling_rounds"
_FILTER, _OVER = SLIME_SAMPLING_FLAGS
_EXAMPLE = f"slime.rollout.filter_hub.dynamic_sampling_filters.{NONZERO_STD_FILTER}"


def sampling_order(flag: str) -> int:
    """Sort key of the sampling flags: the filter (which may turn dynamic sampling on) before the over-sampling
    size (which reads whether it is on)."""
    return 0 if flag == _FILTER else 1


def resolve_sampling(cfg: RunConfig, setter: FieldSetter, flag: str, raw: Any, spelling: str) -> None:
    """Apply ``--flag raw`` of :data:`~megatron_logra.megatron_flags.slime.SLIME_SAMPLING_FLAGS` to ``cfg``
    (through ``setter``, which knows the fields the command line set), or raise a ``ValueError`` naming the flag
    and what to give instead."""
    if cfg.job != "rl":
        raise ValueError(f"--{flag} is slime's dynamic sampling of the RL job, which job={cfg.job} does not have; "
                         f"drop --{flag}")
    if flag == _FILTER:
        _resolve_filter(cfg, setter, str(raw).strip(), spelling)
    else:
        _check_over_sampling(cfg, raw)


def _resolve_filter(cfg: RunConfig, setter: FieldSetter, path: str, spelling: str) -> None:
    """``--dynamic-sampling-filter-path PATH``: slime's nonzero-std filter (by its function's name, under any
    module path) turns dynamic sampling on: ``rl.dynamic_sampling_rounds`` as the line or recipe gives it, else
    :data:`~megatron_logra.megatron_flags.slime.FILTER_ROUNDS` (logged); any other filter is refused."""
    if re.split(r"[.:]", path)[-1] != NONZERO_STD_FILTER:
        raise ValueError(f"--{_FILTER} {path}: only slime's {NONZERO_STD_FILTER} filter (under any module path, e.g. "
                         f"{_EXAMPLE}) maps here, to dynamic sampling, {_FIELD}=N: up to N extra rollout rounds per "
                         f"step replace the groups whose rewards are all equal by fresh prompts' groups; a filter of "
                         f"other groups is not supported: drop --{_FILTER} or give that filter")
    if cfg.rl.advantage.estimator != "grpo":
        raise ValueError(f"--{_FILTER} {path} drops the groups of zero GRPO advantage, but rl.advantage.estimator="
                         f"{cfg.rl.advantage.estimator} gives them a nonzero one: give --advantage-estimator grpo, or "
                         f"drop --{_FILTER}")
    rounds, given = cfg.rl.dynamic_sampling_rounds, setter.set_by.get(_FIELD)
    if rounds > 0:
        where = given[0] if given is not None else "the recipe"
        logger.info("--%s %s: dynamic sampling with %s=%d (%s), up to %d extra rounds of rl.prompts_per_step fresh "
                    "prompts per step", _FILTER, path, _FIELD, rounds, where, rounds)
        return
    if given is not None:
        raise ValueError(f"--{_FILTER} {path} turns dynamic sampling on, but {given[0]} turns it off: give {_FIELD}=N "
                         f"(N >= 1, the extra rounds per step) or drop --{_FILTER}")
    setter.put(_FIELD, FILTER_ROUNDS, spelling, _FILTER)
    logger.warning("--%s %s: dynamic sampling is on with %s=%d: up to %d extra rounds per step, each of "
                   "rl.prompts_per_step fresh prompts, replace the groups whose rewards are all equal (the groups "
                   "slime's %s drops); slime draws until the batch is full with no bound, here at most %d× the step's "
                   "prompts are generated and the groups still uniform after them are trained at advantage 0; give "
                   "%s=N to choose", _FILTER, path, _FIELD, FILTER_ROUNDS, FILTER_ROUNDS, NONZERO_STD_FILTER,
                   FILTER_ROUNDS + 1, _FIELD)


def _check_over_sampling(cfg: RunConfig, raw: Any) -> None:
    """``--over-sampling-batch-size N``: at least ``rl.prompts_per_step`` (``--rollout-batch-size``), as slime
    requires; accepted (logged) with dynamic sampling on, whose extra rounds draw ``rl.prompts_per_step`` prompts
    each, and without it only at ``rl.prompts_per_step``, slime's default, since slime draws more prompts than the
    batch needs only to drop the groups its filter does not pass (without one it aborts the slowest groups)."""
    from megatron_logra.config.codec import _coerce

    value = _coerce(raw, int, f"--{_OVER}")
    per_step, rounds = cfg.rl.prompts_per_step, cfg.rl.dynamic_sampling_rounds
    if value < per_step:
        raise ValueError(f"--{_OVER} {value} is below --rollout-batch-size (rl.prompts_per_step={per_step}), which "
                         f"slime refuses too: give at least {per_step}, or drop --{_OVER}")
    if rounds > 0:
        logger.warning("--%s %d is accepted: each extra round of dynamic sampling draws rl.prompts_per_step=%d fresh "
                       "prompts (slime draws %d at a time until the batch is full), up to %s=%d rounds per step",
                       _OVER, value, per_step, value, _FIELD, rounds)
        return
    if value == per_step:
        logger.info("--%s %d is accepted: without dynamic sampling slime draws --rollout-batch-size prompts per "
                    "rollout, as each step here draws rl.prompts_per_step=%d", _OVER, value, per_step)
        return
    raise ValueError(f"--{_OVER} {value}: slime draws more prompts than --rollout-batch-size only for its dynamic "
                     f"sampling filter (without one it keeps the first {per_step} groups to finish and aborts the "
                     f"rest), and dynamic sampling is off here ({_FIELD}=0): give --{_FILTER} {_EXAMPLE} (or "
                     f"{_FIELD}=N), or drop --{_OVER}")

"""Megatron-LM flags given in a recipe file whose field or value depends on the rest of the config, resolved
again against what a later layer (a file naming this one as its ``recipe:``, or the command line) leaves.

A recipe file's context flags (:data:`RESOLVED_AGAIN`) are first resolved against the file's own config, as the
command line's are against theirs, so a file alone reads as it always did. A later layer that changes what they
depend on changes what they set, as if the flag had been given with that layer:

* ``lr-warmup-fraction: F`` is ``F`` × the final decay length (``optimizer.schedule.decay_steps``, else the
  job's steps): ``examples/tiny.yaml`` with ``lr-warmup-fraction: 0.1`` and ``train.steps=100`` on the command
  line warms up over 10 steps (it kept the file's 25, a quarter of the run);
* ``lr`` / ``weight-decay`` / ``clip-grad`` / ``adam-*`` follow the final optimizer (``--optimizer adam`` on the
  command line: ``lr: 1e-3`` is dense AdamW's ``optimizer.native.lr``, not the unused LoGRA lr);
* ``train-iters`` / ``micro-batch-size`` / ``eval-interval`` / ``global-batch-size`` follow the final job;
* ``max-position-embeddings`` checks the final ``model.seq_length``.

A later layer that gives the same flag, or sets the field the flag resolves to, overrides it (a recipe's values
are defaults for what comes after), and the flag is dropped. ``min-lr`` / ``lr-warmup-init`` need nothing here:
they are stored as the absolute lrs given, which ``validate`` checks against the final peak lr.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

from megatron_logra.config.dotted import set_dotted
from megatron_logra.megatron_flags import (CHECK_FLAGS, JOB_ALIASES, OPTIMIZER_ALIASES, STEP_FRACTION_FLAGS,
                                           check_flag, resolve_alias, step_fraction)

__all__ = ["RESOLVED_AGAIN", "pending_items", "resolve_pending"]

RESOLVED_AGAIN = frozenset(JOB_ALIASES) | frozenset(OPTIMIZER_ALIASES) | frozenset(STEP_FRACTION_FLAGS) \
    | frozenset(CHECK_FLAGS)
"""The context flags of a recipe file that a later layer's config resolves again."""

Pending = tuple[str, Any, str]
"""``(flag, raw value, where)``: a recipe file's context flag, ``where`` naming the file."""


def pending_items(items: Sequence[tuple[str, Any, str]], where: str) -> list[Pending]:
    """The context flags among a recipe file's items ``(key, value, spelling)``, to resolve again later."""
    return [(key, raw, where) for key, raw, _ in items if key in RESOLVED_AGAIN]


def resolve_pending(cfg, pending: Sequence[Pending], later_items: Sequence[tuple[str, Any, str]],
                    later_fields: Collection[str]) -> list[Pending]:
    """Resolve the recipe files' context flags ``pending`` again against ``cfg``, the config a later layer left
    after setting ``later_items`` (its fields: ``later_fields``, canonical dotted names), in place; the aliases
    before the step fractions (which read the steps they set), as the command line's flags are. Returns those
    still in force (not overridden by the later layer) for the layer after. A ``ValueError`` names the file."""
    later_flags = {key for key, _, _ in later_items}
    kept: list[Pending] = []
    order = [p for p in pending if p[0] not in STEP_FRACTION_FLAGS] + [p for p in pending if p[0] in STEP_FRACTION_FLAGS]
    for flag, raw, where in order:
        if flag in later_flags:
            continue  # given again later: the later value counts
        try:
            if flag in CHECK_FLAGS:
                check_flag(cfg, flag, raw)
                kept.append((flag, raw, where))
                continue
            if flag in STEP_FRACTION_FLAGS:
                target, value = step_fraction(cfg, flag, raw)
            else:
                target, value = resolve_alias(cfg, flag, raw), raw
        except ValueError as exc:
            raise ValueError(f"{flag}: {raw} in {where}: {exc}") from None
        if target is None:  # a check only (--global-batch-size of the RL job), which passed
            kept.append((flag, raw, where))
            continue
        if target in later_fields:
            continue  # the later layer set the field itself
        set_dotted(cfg, target, value)
        kept.append((flag, raw, where))
    return kept

"""Prompt tokenization for RL rollouts and the check that a prompt fits the sequence.

Contract: a problem's prompt becomes token ids by ``rl.prompt_template`` (or the tokenizer's chat template)
(:func:`rl_prompt_ids`); a prompt must leave room for ``rl.rollout.max_new_tokens`` within
``model.seq_length + 1`` (:func:`prompt_room`, :func:`check_prompt_fits`: a ``ValueError`` naming the fix
otherwise). :func:`_prompt_batch` tokenizes one batch of problems on every DP rank together, so a prompt that
does not fit is the same error on all of them. :func:`_decode` turns completion ids back into text without
the stop tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from megatron_logra.data.tokenizer import prompt_token_ids
from megatron_logra.parallel import all_gather_bytes

if TYPE_CHECKING:
    from megatron_logra.rl.loop import RLComponents

__all__ = ["rl_prompt_ids", "prompt_room", "check_prompt_fits"]


def rl_prompt_ids(tok: Any, rl_cfg: Any, text: str) -> list[int]:
    """Token ids of a problem's prompt ``text``: ``rl.prompt_template`` around it (``{prompt}`` replaced by
    ``text``; every other brace is literal, e.g. ``\\boxed{}``), then BOS when the tokenizer has one, or
    the tokenizer's chat template with ``rl.chat_template`` (``prompt_token_ids``)."""
    return prompt_token_ids(tok, rl_cfg.prompt_template.replace("{prompt}", text), chat=rl_cfg.chat_template)


def _prompt_ids(c: RLComponents, text: str) -> list[int]:
    """Token ids of a problem's prompt; a prompt that leaves no room for the response is an error."""
    ids = rl_prompt_ids(c.tokenizer, c.cfg.rl, text)
    check_prompt_fits(c.cfg, len(ids), text)
    return ids


def prompt_room(cfg: Any) -> int:
    """The most prompt tokens that leave room for ``rl.rollout.max_new_tokens`` within ``model.seq_length + 1``
    (the last sampled token is never fed back); <= 0 when no prompt fits."""
    return cfg.model.seq_length + 1 - cfg.rl.rollout.max_new_tokens


def check_prompt_fits(cfg, num_ids: int, text: str) -> None:
    """A prompt of ``num_ids`` tokens must fit :func:`prompt_room`; ``ValueError`` naming
    ``model.seq_length`` and ``rl.rollout.max_new_tokens`` and the values that would fit this prompt."""
    seq, new_tokens = cfg.model.seq_length, cfg.rl.rollout.max_new_tokens
    room = prompt_room(cfg)
    if num_ids <= room:
        return
    need = num_ids + new_tokens - 1
    fits = seq + 1 - num_ids  # the most new tokens this prompt leaves room for
    lower = f", lower rl.rollout.max_new_tokens to {fits} or less" if fits >= 1 else ""
    if room > 0:
        what = f"leaves {room} tokens before rl.rollout.max_new_tokens={new_tokens}"
    else:
        what = (f"leaves no room for any prompt before rl.rollout.max_new_tokens={new_tokens} (a sequence holds the "
                "prompt and all but the last of its new tokens)")
    raise ValueError(
        f"a prompt of {num_ids} tokens does not fit: model.seq_length={seq} {what}; raise model.seq_length to "
        f"{need} or more{lower}, or shorten the prompts (prompt starts {text[:60]!r})")


def _prompt_batch(c: RLComponents, problems: list, repeat: int, step: Optional[int] = None) -> list[list[int]]:
    """:func:`_prompt_ids` of every problem, ``repeat`` times each, on every DP rank together: a prompt
    that does not fit on any rank is the same ``ValueError`` on all of them (a rank raising alone would
    leave the others waiting in the step's next collective), naming the RL ``step`` when one is given (the
    training prompts of a generated task are drawn step by step). Every DP rank must call."""
    ids: list[list[int]] = []
    error = ""
    try:
        ids = [list(one) for one in (_prompt_ids(c, p.prompt) for p in problems) for _ in range(repeat)]
    except ValueError as exc:
        error = str(exc)
    errors = [e.decode() for e in all_gather_bytes(error.encode(), c.groups.dp) if e]
    if errors:
        raise ValueError(errors[0] if step is None else f"RL step {step}: {errors[0]}")
    return ids


def _decode(c: RLComponents, ids: list[int]) -> str:
    stop = set(c.stop_token_ids())
    return c.tokenizer.decode([i for i in ids if i not in stop], skip_special_tokens=True)

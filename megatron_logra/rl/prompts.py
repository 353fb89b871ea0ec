"""Prompt tokenization for RL rollouts and the check that a prompt fits the sequence.

Contract: a problem's prompt becomes token ids by ``rl.prompt_template`` (or the tokenizer's chat template)
(:func:`rl_prompt_ids`); a prompt must leave room for its completion within ``model.seq_length + 1``: a training
prompt for ``rl.rollout.max_new_tokens``, a held-out one for the evaluation's cap (``rl.rollout.eval_max_new_tokens``
where set: :func:`~megatron_logra.rl.rollout_config.new_tokens_limit`) (:func:`prompt_room`,
:func:`check_prompt_fits`: a ``ValueError`` naming the fix otherwise); a held-out benchmark none of whose prompts
fits, or an evaluation cap that leaves no room for any prompt, is refused at start (:func:`check_benchmarks_fit`,
:func:`check_held_out_room`). :func:`_prompt_batch` tokenizes one batch of problems on every DP rank together, so
a prompt that does not fit is the same error on all of them. :func:`_decode` turns completion ids back into text
without the stop tokens.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from megatron_logra.data.tokenizer import prompt_token_ids
from megatron_logra.metrics import is_rank0
from megatron_logra.parallel import all_gather_bytes
from megatron_logra.rl.rollout_config import EVAL_MAX_NEW_TOKENS_FIELD, new_tokens_limit

if TYPE_CHECKING:
    from megatron_logra.rl.loop import RLComponents

__all__ = ["rl_prompt_ids", "prompt_room", "check_prompt_fits", "check_benchmarks_fit", "check_held_out_room",
           "warn_unknown_characters"]

logger = logging.getLogger(__name__)

_SHOWN = 5
"""How many characters and lines a warning of :func:`warn_unknown_characters` names."""


def rl_prompt_ids(tok: Any, rl_cfg: Any, text: str) -> list[int]:
    """Token ids of a problem's prompt ``text``: ``rl.prompt_template`` around it (``{prompt}`` replaced by
    ``text``; every other brace is literal, e.g. ``\\boxed{}``), then BOS when the tokenizer has one, or
    the tokenizer's chat template with ``rl.chat_template`` (``prompt_token_ids``)."""
    return prompt_token_ids(tok, rl_cfg.prompt_template.replace("{prompt}", text), chat=rl_cfg.chat_template)


def _prompt_ids(c: RLComponents, text: str, held_out: bool = False) -> list[int]:
    """Token ids of a problem's prompt; a prompt that leaves no room for the response (a held-out one's:
    ``held_out``) is an error."""
    ids = rl_prompt_ids(c.tokenizer, c.cfg.rl, text)
    check_prompt_fits(c.cfg, len(ids), text, held_out=held_out)
    return ids


def prompt_room(cfg: Any, *, held_out: bool = False) -> int:
    """The most prompt tokens that leave room for ``rl.rollout.max_new_tokens`` (``held_out``: the evaluation's
    cap, :func:`~megatron_logra.rl.rollout_config.new_tokens_limit`) within ``model.seq_length + 1`` (the last
    sampled token is never fed back); <= 0 when no prompt fits."""
    return cfg.model.seq_length + 1 - new_tokens_limit(cfg.rl.rollout, held_out=held_out)[0]


def check_prompt_fits(cfg: Any, num_ids: int, text: str, *, held_out: bool = False) -> None:
    """A prompt of ``num_ids`` tokens must fit :func:`prompt_room` (``held_out``: a held-out prompt, room for the
    evaluation's cap); ``ValueError`` naming ``model.seq_length`` and the cap's field (``rl.rollout.max_new_tokens``,
    or ``rl.rollout.eval_max_new_tokens`` for a held-out prompt where that is set) and the values that would fit
    this prompt."""
    seq = cfg.model.seq_length
    new_tokens, field = new_tokens_limit(cfg.rl.rollout, held_out=held_out)
    room = prompt_room(cfg, held_out=held_out)
    if num_ids <= room:
        return
    need = num_ids + new_tokens - 1
    fits = seq + 1 - num_ids  # the most new tokens this prompt leaves room for
    lower = f", lower {field} to {fits} or less" if fits >= 1 else ""
    if room > 0:
        what = f"leaves {room} tokens before {field}={new_tokens}"
    else:
        what = (f"leaves no room for any prompt before {field}={new_tokens} (a sequence holds the "
                "prompt and all but the last of its new tokens)")
    raise ValueError(
        f"a prompt of {num_ids} tokens does not fit: model.seq_length={seq} {what}; raise model.seq_length to "
        f"{need} or more{lower}, or shorten the prompts (prompt starts {text[:60]!r})")


def check_benchmarks_fit(cfg: Any, task: Any, num_tokens: Callable[[str], int]) -> None:
    """Refuse a held-out benchmark (``task.eval_datasets``) none of whose held-out prompts fits
    :func:`prompt_room` for the evaluation's cap, by the rule the training datasets' prompts follow (``num_tokens``: a
    prompt text's tokens by :func:`rl_prompt_ids`): a ``ValueError`` naming it, how many of its prompts do not fit
    and the ``model.seq_length`` (or the cap: ``rl.rollout.max_new_tokens``, or ``rl.rollout.eval_max_new_tokens``
    where set) that fits them all, rather than an evaluation that skips them all and reports ``null``. A benchmark
    some of whose prompts fit keeps its others skipped (one warning, at its first evaluation)."""
    room = prompt_room(cfg, held_out=True)
    seq = cfg.model.seq_length
    new_tokens, field = new_tokens_limit(cfg.rl.rollout, held_out=True)
    problems = task.benchmark_problems()
    for source in task.benchmarks:
        lengths = [num_tokens(p.prompt) for p in problems if p.source == source.name]
        if not lengths or min(lengths) <= room:
            continue
        shortest, longest = min(lengths), max(lengths)
        fits = seq + 1 - longest  # the most new tokens that leave room for every prompt
        lower = f" or lower {field} to {fits} or less" if fits >= 1 else ""
        span, some = f"{longest} tokens", ""
        if shortest < longest:
            span = f"{shortest} to {longest} tokens"
            some = f" (model.seq_length={shortest + new_tokens - 1} fits the shortest)"
        raise ValueError(
            f"task.eval_datasets: {source.name!r} has no held-out prompt that fits: all {len(lengths)} of its "
            f"prompts ({span}) do not fit the {max(room, 0)} tokens of room that model.seq_length={seq} leaves "
            f"before {field}={new_tokens}, so it could never be evaluated; raise "
            f"model.seq_length to {longest + new_tokens - 1} or more{lower} to fit them all{some}, or drop it "
            f"from task.eval_datasets")


def check_held_out_room(cfg: Any) -> None:
    """Refuse a run that evaluates (``task.num_eval`` > 0) with an ``rl.rollout.eval_max_new_tokens`` that leaves no
    room for any held-out prompt within ``model.seq_length`` (:func:`prompt_room` <= 0): a ``ValueError`` naming both
    fields and the values that would leave room, as a training cap that leaves none is refused, rather than a run
    that skips every held-out prompt and reports ``null``. Without the field the training cap's checks apply."""
    new_tokens, field = new_tokens_limit(cfg.rl.rollout, held_out=True)
    if cfg.task.num_eval == 0 or field != EVAL_MAX_NEW_TOKENS_FIELD or prompt_room(cfg, held_out=True) > 0:
        return
    seq = cfg.model.seq_length
    raise ValueError(
        f"{field}={new_tokens} leaves no room for any held-out prompt: model.seq_length={seq} holds a prompt of P "
        f"tokens and all but the last of its new tokens, P + {new_tokens - 1} <= {seq} (task.num_eval="
        f"{cfg.task.num_eval}); raise model.seq_length to {new_tokens - 1} + the held-out prompts' length or more, "
        f"or lower {field} to {seq} - their length or less (0: rl.rollout.max_new_tokens)")


def warn_unknown_characters(tok: Any, rows: Sequence[Any], cfg: Any) -> dict[str, list[int]]:
    """Warn (rank 0), once per source, of the rows (a JSONL file's problems) whose prompt or answer holds
    characters ``tok`` (the run's tokenizer of ``cfg``) has no token for: they reach the policy as ``<unk>`` (a
    prompt) or can never be generated (an answer), and nothing else says so. Names the file, the count, the first
    characters and lines, and where the tokenizer comes from. Returns the lines of such rows by source (empty
    without an ``<unk>`` token, as byte-level tokenizers have a token for every text, and on other ranks)."""
    unk = getattr(tok, "unk_token_id", None)
    if unk is None or not is_rank0():
        return {}
    where = (f"tokenizer.path={cfg.tokenizer.path!r}" if cfg.tokenizer.path else
             f"the tokenizer of model.hf_path={cfg.model.hf_path!r}" if cfg.model.hf_path else
             "the tokenizer built for the task")
    unknown: dict[str, bool] = {}

    def is_unknown(ch: str) -> bool:
        if ch not in unknown:
            unknown[ch] = unk in tok(ch, add_special_tokens=False)["input_ids"]
        return unknown[ch]

    lines: dict[str, list[int]] = {}
    chars: dict[str, set[str]] = {}
    for problem in rows:
        text = problem.prompt + problem.answer
        if unk in tok(text, add_special_tokens=False)["input_ids"]:
            lines.setdefault(problem.source, []).append(problem.metadata.get("line"))
            chars.setdefault(problem.source, set()).update(ch for ch in set(text) if is_unknown(ch))
    for source, found in lines.items():
        total = sum(problem.source == source for problem in rows)
        shown = sorted(chars[source])[:_SHOWN]
        logger.warning("%s: %d of its %d rows hold characters %s has no token for (%s; lines %s): a prompt reaches "
                       "the policy with <unk> in their place and an answer can never be generated; give a tokenizer "
                       "that has them (tokenizer.path, or model.hf_path's own)", source, len(found), total,
                       where, ", ".join(map(repr, shown)) + (", ..." if len(chars[source]) > _SHOWN else ""),
                       ", ".join(map(str, found[:_SHOWN])) + (", ..." if len(found) > _SHOWN else ""))
    return lines


def _prompt_batch(c: RLComponents, problems: list, repeat: int, step: Optional[int] = None, *,
                  held_out: bool = False) -> list[list[int]]:
    """:func:`_prompt_ids` of every problem, ``repeat`` times each, on every DP rank together: a prompt
    that does not fit on any rank is the same ``ValueError`` on all of them (a rank raising alone would
    leave the others waiting in the step's next collective), naming the RL ``step`` when one is given (the
    training prompts of a generated task are drawn step by step). ``held_out``: the held-out evaluation's problems,
    which need room for its own cap. Every DP rank must call."""
    ids: list[list[int]] = []
    error = ""
    try:
        ids = [list(one) for one in (_prompt_ids(c, p.prompt, held_out) for p in problems) for _ in range(repeat)]
    except ValueError as exc:
        error = str(exc)
    errors = [e.decode() for e in all_gather_bytes(error.encode(), c.groups.dp) if e]
    if errors:
        raise ValueError(errors[0] if step is None else f"RL step {step}: {errors[0]}")
    return ids


def _decode(c: RLComponents, ids: list[int]) -> str:
    stop = set(c.stop_token_ids())
    return c.tokenizer.decode([i for i in ids if i not in stop], skip_special_tokens=True)

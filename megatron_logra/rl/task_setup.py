"""The RL run's task, tokenizer and stop tokens, built and checked at start, before any model is built
(:func:`task_and_tokenizer`, run by :func:`~megatron_logra.rl.components.check_config` and
:func:`~megatron_logra.rl.components.build_components`).

Every prompt of a file (JSONL) source must fit ``model.seq_length`` with room for ``rl.rollout.max_new_tokens``,
or, a prompt the held-out evaluation generates from (a benchmark's, or a held-out row of a training file), for
``rl.rollout.eval_max_new_tokens`` where that is set: the longest is checked and a misfit refused, naming its file
and line. A training row longer than ``task.max_prompt_tokens`` (slime's ``--rollout-max-prompt-len``) is skipped
instead, as slime drops it when loading the file; the held-out set is not limited by it, but a held-out row longer
than ``task.eval_max_prompt_tokens`` (slime's ``--eval-max-prompt-len``) is dropped from it. A generated source's
over-long prompts are skipped by the train stream and the held-out set instead (:func:`filter_overlong_prompts`,
each set by its own cap), and a source or benchmark none of whose prompts fits,
or an evaluation cap that leaves no room for any prompt, is refused. Nothing here writes to the run directory.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from megatron_logra.config import RunConfig
from megatron_logra.data.tokenizer import stop_token_ids
from megatron_logra.rewards import build_task
from megatron_logra.rewards.jsonl import file_spec_path
from megatron_logra.rewards.slime_rm import with_run_args
from megatron_logra.rewards.base import PromptFilter
from megatron_logra.rl.prompts import (check_benchmarks_fit, check_held_out_room, check_prompt_fits, prompt_room,
                                       rl_prompt_ids, warn_unknown_characters)
from megatron_logra.rl.rollout_config import check_stop_token_ids, new_tokens_limit
from megatron_logra.rl.warm_start import run_tokenizer

__all__ = ["PROMPT_LENGTH_CACHE", "filter_overlong_prompts", "task_and_tokenizer"]


def task_and_tokenizer(cfg: RunConfig, run_dir: Path, *, will_save: bool, group: Any = None) -> tuple:
    """``(task, tokenizer, stop token ids)`` of the run, checked before any model is built: the task
    (:func:`~megatron_logra.rewards.build_task`: dataset names and kwargs, JSONL files, the reward plugin), the
    tokenizer (:func:`~megatron_logra.rl.warm_start.run_tokenizer`: ``tokenizer.path`` or ``model.hf_path``'s
    tokenizer files, its size against ``model.vocab_size``), ``rl.chat_template``, the longest JSONL prompt
    against ``model.seq_length`` (refused), the filter of over-long generated prompts from the train stream
    and the held-out set (:func:`filter_overlong_prompts`: skipped, or refused when all are) and the stop tokens
    (``generation_config.json``'s and ``rl.rollout.stop_token_ids``, checked against the vocabulary). Nothing is
    written. ``group``: the ranks that build the task together (the job: every rank), which keep the JSONL rows their
    rank 0 keeps (:func:`~megatron_logra.rewards.build_task`)."""
    check_held_out_room(cfg)  # an evaluation cap that leaves no room for any prompt: before anything is built
    # a slime reward function's args name RL fields too (n_samples_per_prompt: rl.group_size); its workers' too
    task = build_task(with_run_args(cfg.task, cfg.rl), group)
    tok = run_tokenizer(cfg, task, run_dir, will_save=will_save)
    if cfg.rl.chat_template:  # refuse a tokenizer without a chat template before building anything
        rl_prompt_ids(tok, cfg.rl, "check")
    # the same on every rank: a long prompt of a file (JSONL) source fails here, not mid-run; the longest one,
    # so that the fix the error suggests fits every prompt the user wrote. A generated source's are skipped.
    rows = [problem for source in task.sources + task.benchmarks for problem in getattr(source, "problems", ())]
    lengths = [(len(rl_prompt_ids(tok, cfg.rl, problem.prompt)), problem) for problem in rows]
    held_out = _held_out_rows(cfg, task)
    caps = {False: cfg.task.max_prompt_tokens or float("inf"),  # rows above a cap are skipped, not refused
            True: cfg.task.eval_max_prompt_tokens or float("inf")}
    for part in (False, True):  # training rows for the training cap, then held-out rows for the evaluation's
        _check_longest([(n, p) for n, p in lengths if held_out(p) == part and n <= caps[part]], cfg, held_out=part)
    warn_unknown_characters(tok, rows, cfg)  # a JSONL row's characters the tokenizer does not have
    filter_overlong_prompts(cfg, task, tok)
    return task, tok, _stop_ids(cfg, tok)


def _stop_ids(cfg: RunConfig, tok: Any) -> list[int]:
    """The ids that end a completion: the tokenizer's end-of-sequence ids (``data.tokenizer.stop_token_ids``) and
    ``rl.rollout.stop_token_ids``, which must be ids of the tokenizer and of ``model.vocab_size``."""
    stops = stop_token_ids(tok, cfg.model.hf_path, cfg.tokenizer.path)
    extra = cfg.rl.rollout.stop_token_ids
    if extra:
        check_stop_token_ids(cfg.rl.rollout, min(len(tok), cfg.model.vocab_size),
                             f"the tokenizer ({len(tok)} tokens) and model.vocab_size={cfg.model.vocab_size}")
    return sorted(set(stops) | set(extra))


def _held_out_rows(cfg: RunConfig, task: Any) -> Callable[[Any], bool]:
    """Which JSONL rows the evaluation generates from under its own cap (``rl.rollout.eval_max_new_tokens`` set
    and ``task.num_eval`` > 0): a benchmark's rows and a training file's eval-only ones. Without the field every
    row is checked against the training cap, as when the two caps were one; with ``task.max_prompt_tokens`` or
    ``task.eval_max_prompt_tokens``, each of which skips the longer rows of its own set only, the held-out rows are
    told apart too."""
    if not (cfg.rl.rollout.eval_max_new_tokens or cfg.task.max_prompt_tokens or cfg.task.eval_max_prompt_tokens) \
            or cfg.task.num_eval == 0:
        return lambda problem: False
    benchmarks = {source.name for source in task.benchmarks}
    return lambda problem: problem.source in benchmarks or task.is_eval_prompt(problem.prompt)


def _check_longest(lengths: list, cfg: RunConfig, *, held_out: bool) -> None:
    """Refuse the longest of ``lengths`` (``(tokens, problem)`` of JSONL rows) when it does not fit the training
    cap (``held_out``: the evaluation's), naming its file and line and how many of its file's rows do not fit."""
    if not lengths:
        return
    longest, problem = max(lengths, key=lambda item: item[0])
    try:
        check_prompt_fits(cfg, longest, problem.prompt, held_out=held_out)
    except ValueError as exc:  # name the row, and how many more of the file's rows are too long
        room, which = prompt_room(cfg, held_out=held_out), "held-out prompts" if held_out else "prompts"
        over = sum(n > room for n, p in lengths if p.source == problem.source)
        path, line = file_spec_path(problem.source), problem.metadata.get("line")
        raise ValueError(f"{path}:{line}: {exc} ({over} of the {sum(p.source == problem.source for _, p in lengths)} "
                         f"{which} of {problem.source!r} do not fit; the longest is on this line)") from None


def _capped(room: PromptFilter, cap: int, num_tokens: Callable[[str], int],
            field: str = "task.max_prompt_tokens", fix: str = "") -> PromptFilter:
    """``room`` (the prompts that fit the model) less the prompts of more than ``cap`` tokens (``field``:
    ``task.max_prompt_tokens``, slime's ``--rollout-max-prompt-len``, or ``task.eval_max_prompt_tokens``, slime's
    ``--eval-max-prompt-len``); ``fix``: what the held-out set's warning names to keep them."""
    def describe(prompt: str) -> str:
        if num_tokens(prompt) <= cap:
            return room.describe(prompt)
        return f"a prompt of {num_tokens(prompt)} tokens is longer than {field}={cap} (prompt starts {prompt[:60]!r})"

    return PromptFilter(lambda prompt: num_tokens(prompt) <= cap and room.fits(prompt), describe, room.limit, fix)


PROMPT_LENGTH_CACHE = 4096
"""Prompt texts whose token counts :func:`filter_overlong_prompts` remembers (an LRU cache)."""


def filter_overlong_prompts(cfg: RunConfig, task: Any, tok: Any) -> None:
    """Make ``task``'s train stream skip prompts longer than :func:`~megatron_logra.rl.prompts.prompt_room`
    (:meth:`~megatron_logra.rewards.task.Task.set_prompt_filter`: one warning per source, a pure function of
    the prompt text, so every rank draws the same problems) and refuse, at start, a source whose draws are all
    over-long (:meth:`~megatron_logra.rewards.task.Task.check_trainable`). A generated source's rare long prompt
    is then skipped rather than failing the run at the step that draws it; the loop's own check stays. The
    held-out set skips them too, or, with ``rl.rollout.eval_max_new_tokens`` set, those that leave no room for that
    cap (a filter of its own, whose warning names it); a benchmark none of whose prompts fits is refused
    (``check_benchmarks_fit``). ``task.max_prompt_tokens`` > 0 also skips the training prompts longer than it
    (:func:`_capped`), not the held-out ones, which then have the filter of their own room."""

    @functools.lru_cache(maxsize=PROMPT_LENGTH_CACHE)
    def num_tokens(prompt: str) -> int:
        return len(rl_prompt_ids(tok, cfg.rl, prompt))

    def length_filter(held_out: bool) -> PromptFilter:
        room = prompt_room(cfg, held_out=held_out)
        new_tokens, field = new_tokens_limit(cfg.rl.rollout, held_out=held_out)
        fields = f"model.seq_length={cfg.model.seq_length}, {field}={new_tokens}"

        def describe(prompt: str) -> str:
            needed = num_tokens(prompt) + new_tokens - 1
            return (f"a prompt of {num_tokens(prompt)} tokens does not fit the {max(room, 0)} tokens of room "
                    f"({fields}; model.seq_length={needed} fits it; prompt starts {prompt[:60]!r})")

        return PromptFilter(lambda prompt: num_tokens(prompt) <= room, describe, field)

    training = length_filter(False)
    own = length_filter(True) if cfg.rl.rollout.eval_max_new_tokens else None  # else the held-out set's is training's
    cap, fix = cfg.task.max_prompt_tokens, ""
    if cap:  # training prompts only: the held-out set keeps the filter of what fits the model
        own, training = own or length_filter(True), _capped(training, cap, num_tokens)
        fix = f"raise task.max_prompt_tokens={cap} (--rollout-max-prompt-len) or model.seq_length"
    eval_cap = cfg.task.eval_max_prompt_tokens
    if eval_cap:  # held-out prompts only, by the same rule (a pure function of the text: the same set on every rank)
        own = _capped(own or length_filter(True), eval_cap, num_tokens, "task.eval_max_prompt_tokens",
                      f"raise task.eval_max_prompt_tokens={eval_cap} (--eval-max-prompt-len)")
    task.set_prompt_filter(training.fits, training.describe, held_out=own, fix=fix)
    task.check_trainable()
    check_benchmarks_fit(cfg, task, num_tokens)
    _check_benchmarks_within(cfg, task, num_tokens)


def _check_benchmarks_within(cfg: RunConfig, task: Any, num_tokens: Callable[[str], int]) -> None:
    """Refuse a held-out benchmark (``task.eval_datasets``) none of whose held-out prompts is within
    ``task.eval_max_prompt_tokens``: it could never be evaluated (its accuracy would be ``null``)."""
    cap = cfg.task.eval_max_prompt_tokens
    if not cap:
        return
    problems = task.benchmark_problems()
    for source in task.benchmarks:
        lengths = [num_tokens(p.prompt) for p in problems if p.source == source.name]
        if lengths and min(lengths) > cap:
            raise ValueError(f"task.eval_datasets: every one of the {len(lengths)} held-out prompts of {source.name!r} "
                             f"is longer than task.eval_max_prompt_tokens={cap} (--eval-max-prompt-len; the shortest "
                             f"has {min(lengths)} tokens), so it could never be evaluated: raise "
                             f"task.eval_max_prompt_tokens to {min(lengths)} or more, or drop it from "
                             f"task.eval_datasets")

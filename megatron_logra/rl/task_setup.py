"""The RL run's task, tokenizer and stop tokens, built and checked at start, before any model is built
(:func:`task_and_tokenizer`, run by :func:`~megatron_logra.rl.components.check_config` and
:func:`~megatron_logra.rl.components.build_components`).

Every prompt of a file (JSONL) source must fit ``model.seq_length`` with room for ``rl.rollout.max_new_tokens``:
the longest is checked and a misfit refused, naming its file and line. A generated source's over-long prompts are
skipped by the train stream and the held-out set instead (:func:`filter_overlong_prompts`), and a source or
benchmark none of whose prompts fits is refused. Nothing here writes to the run directory.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from megatron_logra.config import RunConfig
from megatron_logra.data.tokenizer import stop_token_ids
from megatron_logra.rewards import build_task
from megatron_logra.rewards.jsonl import file_spec_path
from megatron_logra.rewards.slime_rm import with_run_args
from megatron_logra.rl.prompts import (check_benchmarks_fit, check_prompt_fits, prompt_room, rl_prompt_ids,
                                       warn_unknown_characters)
from megatron_logra.rl.warm_start import run_tokenizer

__all__ = ["PROMPT_LENGTH_CACHE", "filter_overlong_prompts", "task_and_tokenizer"]


def task_and_tokenizer(cfg: RunConfig, run_dir: Path, *, will_save: bool, group: Any = None) -> tuple:
    """``(task, tokenizer, stop token ids)`` of the run, checked before any model is built: the task
    (:func:`~megatron_logra.rewards.build_task`: dataset names and kwargs, JSONL files, the reward plugin), the
    tokenizer (:func:`~megatron_logra.rl.warm_start.run_tokenizer`: ``tokenizer.path`` or ``model.hf_path``'s
    tokenizer files, its size against ``model.vocab_size``), ``rl.chat_template``, the longest JSONL prompt
    against ``model.seq_length`` (refused), the filter of over-long generated prompts from the train stream
    and the held-out set (:func:`filter_overlong_prompts`: skipped, or refused when all are) and the stop tokens
    (``generation_config.json``). Nothing is written. ``group``: the ranks that build the task together (the
    job: every rank), which keep the JSONL rows their rank 0 keeps (:func:`~megatron_logra.rewards.build_task`)."""
    # a slime reward function's args name RL fields too (n_samples_per_prompt: rl.group_size); its workers' too
    task = build_task(with_run_args(cfg.task, cfg.rl), group)
    tok = run_tokenizer(cfg, task, run_dir, will_save=will_save)
    if cfg.rl.chat_template:  # refuse a tokenizer without a chat template before building anything
        rl_prompt_ids(tok, cfg.rl, "check")
    # the same on every rank: a long prompt of a file (JSONL) source fails here, not mid-run; the longest one,
    # so that the fix the error suggests fits every prompt the user wrote. A generated source's are skipped.
    rows = [problem for source in task.sources + task.benchmarks for problem in getattr(source, "problems", ())]
    lengths = [(len(rl_prompt_ids(tok, cfg.rl, problem.prompt)), problem) for problem in rows]
    if lengths:
        longest, problem = max(lengths, key=lambda item: item[0])
        try:
            check_prompt_fits(cfg, longest, problem.prompt)
        except ValueError as exc:  # name the row, and how many more of the file's rows are too long
            over = sum(n > prompt_room(cfg) for n, p in lengths if p.source == problem.source)
            path, line = file_spec_path(problem.source), problem.metadata.get("line")
            raise ValueError(f"{path}:{line}: {exc} ({over} of the {sum(p.source == problem.source for p in rows)} "
                             f"prompts of {problem.source!r} do not fit; the longest is on this line)") from None
    warn_unknown_characters(tok, rows, cfg)  # a JSONL row's characters the tokenizer does not have
    filter_overlong_prompts(cfg, task, tok)
    return task, tok, stop_token_ids(tok, cfg.model.hf_path, cfg.tokenizer.path)


PROMPT_LENGTH_CACHE = 4096
"""Prompt texts whose token counts :func:`filter_overlong_prompts` remembers (an LRU cache)."""


def filter_overlong_prompts(cfg: RunConfig, task: Any, tok: Any) -> None:
    """Make ``task``'s train stream skip prompts longer than :func:`~megatron_logra.rl.prompts.prompt_room`
    (:meth:`~megatron_logra.rewards.task.Task.set_prompt_filter`: one warning per source, a pure function of
    the prompt text, so every rank draws the same problems) and refuse, at start, a source whose draws are all
    over-long (:meth:`~megatron_logra.rewards.task.Task.check_trainable`). A generated source's rare long prompt
    is then skipped rather than failing the run at the step that draws it; the loop's own check stays. The
    held-out set skips them too; a benchmark none of whose prompts fits is refused (``check_benchmarks_fit``)."""
    room = prompt_room(cfg)
    fields = f"model.seq_length={cfg.model.seq_length}, rl.rollout.max_new_tokens={cfg.rl.rollout.max_new_tokens}"

    @functools.lru_cache(maxsize=PROMPT_LENGTH_CACHE)
    def num_tokens(prompt: str) -> int:
        return len(rl_prompt_ids(tok, cfg.rl, prompt))

    def describe(prompt: str) -> str:
        needed = num_tokens(prompt) + cfg.rl.rollout.max_new_tokens - 1
        return (f"a prompt of {num_tokens(prompt)} tokens does not fit the {max(room, 0)} tokens of room ({fields}; "
                f"model.seq_length={needed} fits it; prompt starts {prompt[:60]!r})")

    task.set_prompt_filter(lambda prompt: num_tokens(prompt) <= room, describe)
    task.check_trainable()
    check_benchmarks_fit(cfg, task, num_tokens)

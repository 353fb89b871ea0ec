"""The RL job's setup before training: the run's tokenizer (a resumed run's own, ``tokenizer.path``'s,
``model.hf_path``'s or one built for the task) and the policy's warm start (an HF checkpoint, ``sft.init_path``
or a supervised warm start, cached beside the run directory)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from megatron_logra.checkpoint import latest_checkpoint
from megatron_logra.config import RunConfig, to_dict
from megatron_logra.convert.load import load_hf_into_model
from megatron_logra.data.tokenizer import build_tokenizer, load_tokenizer, save_tokenizer
from megatron_logra.metrics import is_rank0
from megatron_logra.parallel import ParallelGroups, world_group
from megatron_logra.rl.loop import rl_prompt_ids
from megatron_logra.rl.sft import load_weights, run_sft, save_weights, warm_start_key
from megatron_logra.rl.teachers import build_teacher
from megatron_logra.rollout.driver import share_from_driver

logger = logging.getLogger(__name__)

__all__ = ["TOKENIZER_DRAWS", "run_tokenizer", "save_run_tokenizer", "tokenizer_texts", "warm_start"]


def run_tokenizer(cfg: RunConfig, task, run_dir: Path, *, will_save: bool):
    """The run's tokenizer: a resumed run's ``RUN/tokenizer``; else ``tokenizer.path``'s, else (with
    ``model.hf_path``) the checkpoint's, else one built for the task. Nothing is written here: the caller
    saves it (:func:`save_run_tokenizer`) once the run directory is claimed, unless ``will_save`` is false
    (evaluation never writes into the run directory). A resumed run whose ``RUN/tokenizer`` is
    missing gets one from the config as above, with a warning naming the missing directory and the source used
    (it is the run's tokenizer only if that source is unchanged since the run started).
    A run started with ``train.resume=true`` but no checkpoint yet is a new run: no warning.
    A tokenizer with more tokens than ``model.vocab_size`` rows is a ValueError naming both, before it is saved."""
    saved = run_dir / "tokenizer"
    if cfg.train.resume and saved.exists():
        tok, source = load_tokenizer(saved), f"the run's saved tokenizer {saved}"
    else:
        if cfg.model.hf_path and not cfg.tokenizer.path:  # a real checkpoint brings its tokenizer
            tok = load_tokenizer(cfg.model.hf_path)
            source = f"the tokenizer of model.hf_path={cfg.model.hf_path!r}"
        else:
            tok = build_tokenizer(cfg.tokenizer, tokenizer_texts(task))
            source = (f"tokenizer.path={cfg.tokenizer.path!r}" if cfg.tokenizer.path
                      else f"the {cfg.tokenizer.kind} tokenizer built for the task (tokenizer.path empty)")
        if cfg.train.resume and is_rank0() and latest_checkpoint(run_dir) is not None:
            logger.warning("%s is missing: using %s instead, which is the run's tokenizer only if it has not "
                           "changed since the run started (restore %s to use the run's own)%s", saved, source, saved,
                           "" if will_save else "; not saved into the run directory")
    if len(tok) > cfg.model.vocab_size:
        fix = ("give a tokenizer made for this checkpoint (tokenizer.path=, empty, takes model.hf_path's own)"
               if cfg.model.hf_path else "raise model.vocab_size or give a smaller tokenizer")
        raise ValueError(f"{source} has {len(tok)} tokens but model.vocab_size={cfg.model.vocab_size} (the model's "
                         f"embedding rows): token ids past it have no embedding; {fix}")
    return tok


TOKENIZER_DRAWS = 64
"""Train-stream problems whose text a tokenizer built for the task is made from (with every row of a file source)."""


def tokenizer_texts(task) -> list[str]:
    """The texts a tokenizer built for ``task`` is made from: prompt and answer of every row of its file (JSONL)
    sources, train and held-out alike, so that no character of the user's own rows becomes ``<unk>``, of every
    held-out problem of its benchmarks (``task.eval_datasets``) and of the first :data:`TOKENIZER_DRAWS` problems
    of the train stream (a generated source's are drawn, not listed)."""
    rows = [problem for source in task.sources + task.benchmarks for problem in getattr(source, "problems", ())]
    rows += task.benchmark_problems() + [task.train_problem(i) for i in range(TOKENIZER_DRAWS)]
    return [problem.prompt + " " + problem.answer for problem in rows]


def save_run_tokenizer(cfg: RunConfig, tok, run_dir: Path) -> None:
    """``tok`` into ``RUN/tokenizer`` (rank 0), unless a resumed run already has it there."""
    saved = run_dir / "tokenizer"
    if is_rank0() and not (cfg.train.resume and saved.exists()):
        save_tokenizer(tok, saved)


def warm_start(cfg: RunConfig, model, groups: ParallelGroups, task, tok) -> None:
    """Load the policy's starting weights into ``model``: ``model.hf_path``'s checkpoint, else ``sft.init_path``,
    else a supervised warm start of ``sft.steps`` on the teacher's demonstrations (reused from, and saved to,
    the cache beside the run directory with ``sft.cache``); random weights with ``sft.steps=0``."""
    if cfg.model.hf_path:
        stats = load_hf_into_model(model, groups, cfg.model.hf_path, cfg.model)
        logger.info("started from %s (%d tensors, %.1fs); no supervised warm start", cfg.model.hf_path,
                    stats["tensors"], stats["seconds"])
        return
    if cfg.sft.init_path:
        try:
            load_weights(model, groups, Path(cfg.sft.init_path), vocab_size=cfg.model.vocab_size)
        except ValueError as exc:
            raise ValueError(f"sft.init_path={cfg.sft.init_path!r} does not load into this model: {exc}. A warm start "
                             f"fits only the model config it was made for; set sft.init_path= (empty) to train one "
                             f"for this model, or make one with tools/make_warm_start.py") from exc
        return
    if cfg.sft.steps == 0:
        logger.warning("no model.hf_path, sft.init_path or supervised warm start (sft.steps=0): "
                       "RL starts from random weights")
        return
    key = warm_start_key({"model": to_dict(cfg.model), "task": to_dict(cfg.task), "sft": to_dict(cfg.sft),
                         "template": cfg.rl.prompt_template, "seed": cfg.train.seed,
                         **({"chat_template": True} if cfg.rl.chat_template else {}),
                         "vocab": tok.get_vocab() if hasattr(tok, "get_vocab") else None})
    cache = Path(cfg.train.run_dir).parent / ".cache" / f"warm_start_{key}.safetensors"
    # one decision for all ranks: a cache another job has just written may not be visible everywhere yet,
    # and ranks that disagreed would run different collectives (the warm start's vs none)
    if cfg.sft.cache and share_from_driver(cache.exists, world_group()):
        logger.info("warm start: reusing %s", cache)
        load_weights(model, groups, cache, vocab_size=cfg.model.vocab_size)
        return

    teacher = build_teacher(cfg.sft.teacher, cfg.sft.teacher_kwargs)

    def demo(index: int):
        problem = task.train_problem(1_000_000_000 + index)  # disjoint from the RL stream's indices
        prompt = rl_prompt_ids(tok, cfg.rl, problem.prompt)
        answer = tok(teacher(problem, index), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return prompt, answer

    t0 = time.perf_counter()

    def log(step: int, loss: float) -> None:
        if is_rank0() and (step % 50 == 0 or step == cfg.sft.steps):
            logger.info("warm start step %d/%d loss %.4f", step, cfg.sft.steps, loss)

    loss = run_sft(model, groups, demo, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                   micro_batch_size=cfg.rl.micro_batch_size, max_tokens=cfg.rl.max_tokens_per_micro_batch,
                   pad_id=tok.pad_token_id,
                   max_length=cfg.model.seq_length, multiple=cfg.sequence_multiple(),
                   log=log, final_lr_ratio=cfg.sft.final_lr_ratio)
    logger.info("warm start done in %.0fs (loss %.4f)", time.perf_counter() - t0, loss)
    if cfg.sft.cache:
        save_weights(model, groups, cache, meta={"sft_loss": loss, "key": key})

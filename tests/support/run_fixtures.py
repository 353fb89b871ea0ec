"""Small inputs several test files need: a tiny Llama ``config.json``, a run directory with an (empty) latest
checkpoint whose ``config.yaml`` and ``meta.json`` record lm-tiny's config, and small RL components."""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import yaml

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 160,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
"""A Hugging Face ``config.json`` of a two-layer Llama (no weights)."""


def tiny_llama_dir(root: Path, *, tokenizer: bool = False) -> Path:
    """``root/hf`` holding :data:`TINY_LLAMA` as ``config.json``; with ``tokenizer``, the character tokenizer too
    (104 tokens: what ``train`` and ``config`` load from a checkpoint; its prompts of the ``tiny`` task need
    ``model.seq_length=96``)."""
    d = root / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    if tokenizer:
        from megatron_logra.data.tokenizer import build_char_tokenizer, save_tokenizer

        save_tokenizer(build_char_tokenizer(), d)
    return d


def fake_run_dir(run: Path, recipe: str = "lm-tiny"):
    """A run directory of ``recipe`` (lm-tiny by default) whose latest checkpoint (step 2) holds only
    ``meta.json``: enough for what is read before a checkpoint's tensors (``config --resume``, the architecture
    check). Returns the config."""
    from megatron_logra.config import to_dict, load_recipe

    cfg = load_recipe(recipe)
    cfg.train.run_dir = str(run)
    step = run / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    from megatron_logra.checkpoint.integrity import FORMAT_VERSION

    (step / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "step": 2, "config": to_dict(cfg)}))
    (run / "checkpoints" / "latest").write_text(step.name)
    return cfg


def run_recipe(recipe: str, overrides: list, *, check_resume: bool = False) -> dict:
    """The job of ``recipe`` (``run_rl`` or ``run_lm``, by its ``job``) with ``overrides`` in this process,
    warnings silenced, megatron's parallel state destroyed afterwards (also on failure); returns the summary.
    ``check_resume``: first refuse what ``train`` refuses for a bare ``--resume`` (``check_recipe_resume``)."""
    import warnings

    from megatron_logra.cli.resume import check_recipe_resume
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl
    from megatron_logra.train.lm import run_lm

    cfg = parse_args_to_config(recipe, list(overrides))
    if check_resume and cfg.train.resume:
        check_recipe_resume(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return run_rl(cfg) if cfg.job == "rl" else run_lm(cfg)
        finally:
            destroy_parallel()


def run_rl_recipe(recipe: str, overrides: list) -> dict:
    """:func:`run_recipe` of an RL recipe."""
    return run_recipe(recipe, overrides)


def saved_with_ratios(recipe: str, overrides: list, ratios: dict) -> dict:
    """The config (as ``config.yaml`` holds it) of a run of ``recipe`` with ``overrides`` saved before the
    schedule's absolute lrs existed: each field of ``ratios`` (``min_lr``, ``warmup_init_lr``) absent, its ratio
    field (``optimizer.schedule.ABSOLUTE_LRS``) set to the value given, as its flag was kept then."""
    from megatron_logra.config import to_dict
    from megatron_logra.optim.schedule import ABSOLUTE_LRS
    from megatron_logra.config import parse_args_to_config

    saved = to_dict(parse_args_to_config(recipe, list(overrides)))
    schedule = saved["optimizer"]["schedule"]
    for name, ratio in ratios.items():
        del schedule[name]
        schedule[ABSOLUTE_LRS[name]] = ratio
    return saved


SMALL_RL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "sft.steps=5", "sft.init_path=",
            "tokenizer.path=", "sft.cache=false", "rl.eval_interval=0", "train.progress=false"]
"""Overrides of the ``tiny`` recipe for RL components built in a test: a 2-layer model, a 5-step warm start."""


@contextmanager
def rl_components(run_dir: Path, overrides: list):
    """``(components, state)`` of the ``tiny`` recipe with :data:`SMALL_RL` and ``overrides`` in ``run_dir``,
    built in this process with one torch thread; the parallel state is torn down on exit."""
    import torch

    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = parse_args_to_config("tiny", [*SMALL_RL, *overrides, f"train.run_dir={run_dir}"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            comps, state, _ = build_components(cfg)
        yield comps, state
    finally:
        destroy_parallel()
        torch.set_num_threads(before)


LONGER_CHAIN_SUM = '{"chain_sum": {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 1}}'
"""``task.dataset_kwargs`` of chain_sum with 2..6 one-digit terms: prompts of 20, 24, 28, 32 and 36 tokens with the
tiny recipe's tokenizer (the prompt-cap tests)."""


def task_and_tokenizer(cfg, tmp_path: Path):
    """The task and tokenizer run config ``cfg`` builds (in ``tmp_path/run``, nothing saved), without a model."""
    from megatron_logra.rl.components import _task_and_tokenizer

    task, tok, _ = _task_and_tokenizer(cfg, tmp_path / "run", will_save=False)
    return task, tok

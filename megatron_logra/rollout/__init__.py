"""Rollout engines: the protocol the RL loop uses, the embedded (transformers) engine, the SGLang engine,
and :func:`build_engine`, which picks one from ``rl.rollout.engine``."""

from __future__ import annotations

from typing import Any

from megatron_logra.rollout.engine import Rollout, RolloutEngine, SamplingParams

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "EmbeddedEngine", "SGLangEngine", "build_engine"]


def build_engine(cfg: Any, model: Any, groups: Any, tokenizer: Any = None) -> Any:
    """The rollout engine ``cfg.rl.rollout.engine`` names, at weight version 0 (``PolicySync.full`` loads it).

    ``embedded``: a transformers copy on the trainer model's device in the trainer's compute dtype
    (``model.params_dtype``, so sketch deltas merge bit for bit on both sides; every rank owns one,
    and rank 0 of each model-parallel group samples for the group); ``tokenizer`` (the run's) decodes its
    completions for stop strings (``rl.rollout.stop``).
    ``sglang``: :meth:`SGLangEngine.from_config` (one driving rank per engine; see its module).
    """
    kind = cfg.rl.rollout.engine
    if kind == "embedded":
        from megatron_logra.rollout.embedded import EmbeddedEngine
        from megatron_logra.train.step import model_device

        return EmbeddedEngine(cfg.model, init_seed=cfg.train.seed, tp=groups.tp_size, device=model_device(model),
                              dtype=cfg.model.torch_dtype, gen_group=getattr(groups, "mp", None),
                              tokenizer=tokenizer)
    if kind == "sglang":
        from megatron_logra.rollout.sglang_engine import SGLangEngine

        return SGLangEngine.from_config(cfg, groups)
    raise ValueError(f"rl.rollout.engine={kind!r}: choose embedded or sglang")


def __getattr__(name: str):
    # The engines import transformers / SGLang clients (slow): load them only when asked for.
    if name == "EmbeddedEngine":
        from megatron_logra.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine
    if name == "SGLangEngine":
        from megatron_logra.rollout.sglang_engine import SGLangEngine

        return SGLangEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Rollout engines: the protocol the RL loop uses and the embedded (transformers) engine."""

from megatron_logra.rollout.engine import Rollout, RolloutEngine, SamplingParams

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "EmbeddedEngine"]


def __getattr__(name: str):
    # EmbeddedEngine imports transformers (slow): load it only when asked for.
    if name == "EmbeddedEngine":
        from megatron_logra.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

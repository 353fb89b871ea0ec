"""Configuration of the RL job."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_logra.rl.advantages import AdvantageConfig
from megatron_logra.rl.losses import LossConfig

__all__ = ["RolloutConfig", "SFTConfig", "RLConfig"]


@dataclass
class RolloutConfig:
    """Sampling of the rollout engine."""

    engine: str = "embedded"
    """embedded (a transformers copy of the policy in this process)."""
    temperature: float = 1.0
    """Sampling temperature τ (also the temperature of trainer log-probs and the KL probe)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 8
    """Completion length cap."""
    eval_temperature: float = 0.0
    """Temperature of held-out evaluation (0 = greedy)."""
    eval_samples: int = 1
    """Samples per held-out problem; accuracy is their mean (mean@k, "pass@1 over k samples")."""

    def __post_init__(self) -> None:
        if self.engine not in ("embedded",):
            raise ValueError(f"rl.rollout.engine={self.engine!r}: only 'embedded' is available on this build")
        if self.temperature <= 0:
            raise ValueError(f"rl.rollout.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rl.rollout.top_p={self.top_p} must lie in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"rl.rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.eval_temperature < 0:
            raise ValueError(f"rl.rollout.eval_temperature={self.eval_temperature} must be >= 0")
        if self.eval_samples < 1:
            raise ValueError(f"rl.rollout.eval_samples={self.eval_samples} must be >= 1")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError("rl.rollout.eval_samples > 1 needs rl.rollout.eval_temperature > 0 (greedy samples are identical)")


@dataclass
class SFTConfig:
    """Supervised warm start on task demonstrations (prompt -> reference answer)."""

    steps: int = 300
    """Optimizer steps of dense AdamW; 0 skips the warm start."""
    lr: float = 3e-3
    """AdamW learning rate."""
    batch_size: int = 64
    """Demonstrations per step (global)."""
    cache: bool = True
    """Reuse a warm start already trained with the same model/task/SFT settings (runs/.cache)."""
    init_path: str = ""
    """Load the warm-start weights from this safetensors file instead of training them."""
    final_lr_ratio: float = 1.0
    """Learning rate at the last step as a fraction of ``lr``, reached by cosine decay (1.0 = constant)."""
    teacher: str = "reference"
    """Who writes the demonstrations: ``reference`` (the dataset's answers), ``careless_arithmetic``
    (a weak teacher with a systematic slip, see ``rl/teachers.py``) or ``package.module:factory``."""
    teacher_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the teacher factory (e.g. ``{"slip_rate": 0.6}``)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("sft.steps must be >= 0, sft.batch_size >= 1 and sft.lr > 0")
        if not 0.0 <= self.final_lr_ratio <= 1.0:
            raise ValueError(f"sft.final_lr_ratio={self.final_lr_ratio} must be in [0, 1]")
        if not isinstance(self.teacher_kwargs, dict):
            raise ValueError(f"sft.teacher_kwargs must be a mapping, got {self.teacher_kwargs!r}")


@dataclass
class RLConfig:
    """The RL loop: rollout -> reward -> advantage -> LoGRA update with KL control -> sync."""

    steps: int = 60
    """RL updates."""
    prompts_per_step: int = 16
    """Prompts per update over all data-parallel ranks."""
    group_size: int = 8
    """Samples per prompt (G)."""
    micro_batch_size: int = 32
    """Sequences per trainer micro-batch."""
    eval_interval: int = 10
    """Updates between held-out evaluations (and one before the first, one after the last)."""
    prompt_template: str = "{prompt}\n"
    """How a problem's text becomes the model prompt."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Objective."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name}={getattr(self, name)} must be >= 1")
        if self.eval_interval < 0:
            raise ValueError(f"rl.eval_interval={self.eval_interval} must be >= 0")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("rl.prompt_template must contain {prompt}")

"""Configuration of the RL job (the layout checks of its batch sizes: :mod:`megatron_logra.rl.batch_layout`; the
rollout engine's settings, ``rl.rollout``: :mod:`megatron_logra.rl.rollout_config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_logra.rl.advantages import AdvantageConfig
from megatron_logra.rl.batch_layout import check_rl_batch_layout, share_per_rank
from megatron_logra.rl.checks import check_finite_fields
from megatron_logra.rl.losses import LossConfig
from megatron_logra.rl.rollout_config import RolloutConfig

__all__ = ["RolloutConfig", "SFTConfig", "RLConfig",
           # re-exported from megatron_logra.rl.batch_layout
           "check_rl_batch_layout", "share_per_rank"]


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
        check_finite_fields("sft", self)
        if self.steps < 0:
            raise ValueError(f"sft.steps={self.steps} must be >= 0 (0 skips the supervised warm start)")
        if self.batch_size < 1:
            raise ValueError(f"sft.batch_size={self.batch_size} must be >= 1 (demonstrations per warm-start step)")
        if self.lr <= 0:
            raise ValueError(f"sft.lr={self.lr} must be > 0 (to skip the warm start set sft.steps=0)")
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
    """Sequences per trainer micro-batch (the RL steps' and the supervised warm start's), unless
    ``max_tokens_per_micro_batch`` is set."""
    max_tokens_per_micro_batch: int = 0
    """Dynamic micro-batches (slime's ``--use-dynamic-batch-size --max-tokens-per-gpu N``): each rank's
    sequences of an RL step (and of a supervised warm start's step) are grouped by length into micro-batches of at
    most this many positions (rows × the micro-batch's longest sequence, rounded to the sequence multiple), each cut
    to its own longest, so short completions are not padded to the step's longest; a sequence longer than the
    budget is a micro-batch of its own. The same update up to the order of float sums. Needs ``parallel.pp=1``.
    0 = fixed micro-batches of ``micro_batch_size`` sequences padded to the step's longest."""
    eval_interval: int = 10
    """Updates between held-out evaluations (and one before the first, one after the last)."""
    dynamic_sampling_rounds: int = 0
    """Dynamic sampling (DAPO): up to this many extra rollout rounds per step replace groups whose rewards are all
    equal (GRPO advantage 0: no learning signal) by groups of fresh prompts whose rewards differ; each round
    samples ``prompts_per_step`` new prompts over all DP ranks, and runs only while some rank's batch still
    holds such a group. ``reward_mean`` / ``accuracy`` are then over every rollout generated;
    ``groups_resampled`` / ``groups_uniform`` count the groups replaced and left. 0 = off (GRPO only)."""
    overlong_buffer: int = 0
    """DAPO's soft over-long penalty: a completion longer than ``rl.rollout.max_new_tokens − overlong_buffer``
    tokens loses reward linearly with its length, up to ``overlong_penalty`` at ``max_new_tokens`` (one cut at
    the limit loses all of it); held-out accuracy is not affected. 0 = off."""
    overlong_penalty: float = 1.0
    """The reward a completion of ``max_new_tokens`` tokens loses (``overlong_buffer`` > 0)."""
    log_samples: int = 0
    """Write what the policy generated to ``RUN/samples.jsonl`` (rank 0), to read its answers as training goes:
    each step the first ``log_samples`` rollouts of DP rank 0's batch (prompt, completion, gold answer, reward,
    correct, advantage, tokens, finished) and at each held-out evaluation (step 0 before training) the completions
    of DP rank 0's first ``log_samples`` held-out problems. 0 = none. A resume drops the records after its
    checkpoint, as ``metrics.jsonl`` does."""
    max_bad_steps: int = 5
    """Stop with an error naming the step after this many RL steps in a row refused their update (a non-finite
    loss, sketch or gradient; no completion token); 0 = never stop. A step of zero advantages does not count."""
    prompt_template: str = "{prompt}\n"
    """How a problem's text becomes the model prompt: ``{prompt}`` is replaced by it; other braces are literal
    (``"{prompt}\\nPut your final answer within \\\\boxed{}."``), not ``str.format`` fields."""
    chat_template: bool = False
    """Wrap the templated prompt as one user message in the tokenizer's chat template (with the
    assistant turn opened), as Instruct checkpoints expect; the tokenizer must have one."""
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
        if isinstance(self.max_tokens_per_micro_batch, bool) or not isinstance(self.max_tokens_per_micro_batch, int) \
                or self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"rl.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch!r} must be a whole "
                             f"number >= 0 (positions per dynamic micro-batch; 0 = fixed micro-batches of "
                             f"rl.micro_batch_size sequences)")
        if self.dynamic_sampling_rounds < 0:
            raise ValueError(f"rl.dynamic_sampling_rounds={self.dynamic_sampling_rounds} must be >= 0 (0 = off)")
        if self.dynamic_sampling_rounds and self.advantage.estimator != "grpo":
            raise ValueError(f"rl.dynamic_sampling_rounds={self.dynamic_sampling_rounds} replaces groups of zero GRPO "
                             f"advantage, but rl.advantage.estimator={self.advantage.estimator!r} gives them a "
                             f"nonzero one: set rl.advantage.estimator=grpo or rl.dynamic_sampling_rounds=0")
        if not 0 <= self.overlong_buffer <= self.rollout.max_new_tokens:
            raise ValueError(f"rl.overlong_buffer={self.overlong_buffer} must lie in [0, rl.rollout.max_new_tokens="
                             f"{self.rollout.max_new_tokens}] (0 = off)")
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
            raise ValueError(f"rl.overlong_penalty={self.overlong_penalty} must be a finite number >= 0")
        if self.max_bad_steps < 0:
            raise ValueError(f"rl.max_bad_steps={self.max_bad_steps} must be >= 0 (0 = never stop)")
        if self.eval_interval < 0:
            raise ValueError(f"rl.eval_interval={self.eval_interval} must be >= 0")
        if isinstance(self.log_samples, bool) or not isinstance(self.log_samples, int) or self.log_samples < 0:
            raise ValueError(f"rl.log_samples={self.log_samples!r} must be a whole number >= 0 (the rollouts written "
                             f"to RUN/samples.jsonl per step; 0 = none)")
        if not isinstance(self.prompt_template, str) or "{prompt}" not in self.prompt_template:
            raise ValueError(f"rl.prompt_template={self.prompt_template!r} must contain {{prompt}}, which is replaced "
                             "by the problem's text: add it, e.g. '{prompt}\\n'")
        if self.group_size == 1 and self.dynamic_sampling_rounds:
            raise ValueError(f"rl.dynamic_sampling_rounds={self.dynamic_sampling_rounds} replaces groups whose rewards "
                             f"are all equal, and with rl.group_size=1 every group is one: set rl.group_size >= 2 or "
                             f"rl.dynamic_sampling_rounds=0")
        if self.group_size == 1 and self.advantage.estimator == "grpo" and self.advantage.baseline != "none":
            raise ValueError("rl.group_size=1 with rl.advantage.estimator=grpo gives every sample an advantage of 0 "
                             "(a group of one is its own mean), so nothing is learned: set rl.group_size >= 2 or "
                             "rl.advantage.estimator=reinforce (or rl.advantage.baseline=none: the raw rewards are "
                             "the advantages)")


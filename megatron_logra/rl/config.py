"""Configuration of the RL job (the layout checks of its batch sizes: :mod:`megatron_logra.rl.batch_layout`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_logra.rl.advantages import AdvantageConfig
from megatron_logra.rl.batch_layout import check_rl_batch_layout, share_per_rank
from megatron_logra.rl.checks import check_finite_fields
from megatron_logra.rl.losses import LossConfig
from megatron_logra.rollout.sglang_setup import REDACTED_API_KEY

__all__ = ["RolloutConfig", "SFTConfig", "RLConfig",
           # re-exported from megatron_logra.rl.batch_layout
           "check_rl_batch_layout", "share_per_rank"]


@dataclass
class RolloutConfig:
    """Sampling of the rollout engine."""

    engine: str = "embedded"
    """``embedded`` (a transformers copy of the policy in this process; CPU recipes) or ``sglang``
    (``megatron_logra.rollout.sglang_engine``: an in-process ``sglang.Engine`` per DP replica, or the
    server at ``sglang_url``; GPU only)."""
    sglang_url: str = ""
    """Base URL of a running SGLang server (started with ``--custom-weight-loader
    megatron_logra.sync.sglang_loader.sync_loader``); empty: start an in-process ``sglang.Engine``."""
    sglang_api_key: str = ""
    """The server's ``--api-key`` (sent as a bearer token); empty: the environment variable ``SGLANG_API_KEY``,
    or none when that is unset too. Never written to disk: saved configs (``RUN/config.yaml``, checkpoints)
    hold ``"***"`` instead, and ``"***"`` read back (``train --resume RUN``) counts as empty, so a resumed
    run takes the key from ``SGLANG_API_KEY`` or from ``rl.rollout.sglang_api_key=...`` given again."""
    sglang_admin_api_key: str = ""
    """The server's ``--admin-api-key`` (newer SGLang), sent instead of ``sglang_api_key`` on its weight routes
    (``update_weights_from_tensor``, ``get_weights_by_name``, ``update_weight_version``), which with both keys
    set take only this one; empty: the environment variable ``SGLANG_ADMIN_API_KEY``, or none. Kept off disk
    like ``sglang_api_key``."""
    sglang_timeout: float = 600.0
    """Seconds each HTTP request to the server may take (generation and weight updates)."""
    sglang_serialization: str = "auto"
    """How dense tensors travel to a server: ``pickle`` (by value, base64 in JSON, once per server TP
    rank: any host, but a 27B refit is hundreds of GB of JSON), ``cuda_ipc`` (CUDA IPC handles: a
    server on the same host whose ``CUDA_VISIBLE_DEVICES`` includes the trainer's GPUs; its schedulers open
    CUDA contexts there) or ``auto`` (``pickle``: whether a server sees the trainer's GPUs cannot be told
    from its URL or arguments, ``rollout.sglang_api.resolve_serialization``)."""
    mem_fraction_static: float = 0.3
    """Share of each GPU's memory the in-process SGLang engine reserves for itself (weights + KV cache);
    the trainer lives in the rest (``megatron-logra memory --engine-fraction`` plans it). SGLang's own
    ``mem_fraction_static`` is a fraction of the memory free when the engine starts, so the engine is
    given ``share * total / free`` (``rollout.sglang_api.sglang_mem_fraction``)."""
    sglang_tp: int = 0
    """Tensor-parallel size of the in-process engine; 0 = the trainer's ``parallel.tp`` (its GPUs). Its GPUs
    ``[current device, + sglang_tp)`` must exist and be this DP replica's own (checked when the engine is built:
    ``rollout.sglang_setup.check_engine_gpus``)."""
    sglang_sampling_seed: bool = False
    """Send a per-request ``sampling_seed`` (reproducible rollouts on SGLang versions that support it).
    Request ``i`` of a call takes the ``i``-th output of a splitmix64 stream seeded with the call's sampling
    seed, cut to 31 bits (``rollout.sglang_api.request_seeds``): seeds fit SGLang's int32, are distinct within
    a call, and those of different DP ranks and steps coincide only by chance, never systematically.
    SGLang honours it only in deterministic mode: the in-process engine is started with
    ``enable_deterministic_inference=True`` (it needs a deterministic attention backend such as
    ``flashinfer``, ``fa3`` or ``triton``); a server must be started with
    ``--enable-deterministic-inference`` (a warning says when it was not). Off: SGLang samples from
    its own generator (seeded once with ``train.seed``)."""
    sglang_engine_args: dict = field(default_factory=dict)
    """Extra ``sglang.Engine`` keyword arguments (ServerArgs), e.g. ``{"attention_backend": "triton"}``."""
    temperature: float = 1.0
    """Sampling temperature τ (also the temperature of trainer log-probs and the KL probe)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 8
    """Completion length cap."""
    eval_temperature: float = 0.0
    """Temperature of held-out evaluation (0 = greedy)."""
    eval_samples: int = 1
    """Samples per held-out problem; accuracy is their mean (mean@k, "pass@1 over k samples"), and above 1 the
    records also hold ``eval_pass_at_k`` (the share of problems with a correct one among the k)."""

    def __post_init__(self) -> None:
        check_finite_fields("rl.rollout", self)
        for key_field, env in (("sglang_api_key", "SGLANG_API_KEY"), ("sglang_admin_api_key", "SGLANG_ADMIN_API_KEY")):
            if not isinstance(getattr(self, key_field), str):
                raise ValueError(f"rl.rollout.{key_field} must be a string (or empty: the {env} variable)")
            if getattr(self, key_field) == REDACTED_API_KEY:  # a saved config's placeholder, not a key
                setattr(self, key_field, "")
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"rl.rollout.engine={self.engine!r}: choose embedded or sglang")
        if self.sglang_url and self.engine != "sglang":
            raise ValueError(f"rl.rollout.sglang_url={self.sglang_url!r} needs rl.rollout.engine=sglang")
        if self.sglang_url and not self.sglang_url.startswith(("http://", "https://")):
            raise ValueError(f"rl.rollout.sglang_url={self.sglang_url!r} must start with http:// or https://")
        if not self.sglang_timeout > 0:
            raise ValueError(f"rl.rollout.sglang_timeout={self.sglang_timeout} must be > 0")
        if self.sglang_serialization not in ("auto", "pickle", "cuda_ipc"):
            raise ValueError(f"rl.rollout.sglang_serialization={self.sglang_serialization!r}: "
                             "choose auto, pickle or cuda_ipc")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"rl.rollout.mem_fraction_static={self.mem_fraction_static} must lie in (0, 1)")
        if isinstance(self.sglang_tp, bool) or not isinstance(self.sglang_tp, int) or self.sglang_tp < 0:
            raise ValueError(f"rl.rollout.sglang_tp={self.sglang_tp!r} must be an int >= 0 (0 = parallel.tp)")
        if not isinstance(self.sglang_engine_args, dict):
            raise ValueError(f"rl.rollout.sglang_engine_args must be a mapping, got {self.sglang_engine_args!r}")
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
    """Sequences per trainer micro-batch."""
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
        if self.group_size == 1 and self.advantage.estimator == "grpo":
            raise ValueError("rl.group_size=1 with rl.advantage.estimator=grpo gives every sample an advantage of 0 "
                             "(a group of one is its own mean), so nothing is learned: set rl.group_size >= 2 or "
                             "rl.advantage.estimator=reinforce")


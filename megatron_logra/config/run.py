"""Run configuration: each component's dataclass composed into :class:`RunConfig`, with the checks that
span sections (sequence shapes, the TP / PP split, dense AdamW, the lr schedule, low-precision delta sync).

Each section's dataclass lives with its component (``models.gpt.ModelConfig``, ``optim.config``,
``rl.config``, ``kl.controller``, ``sync.config``, ...; the ``train`` section is
:mod:`megatron_logra.config.train`) and validates its own fields in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_logra.config.train import TrainConfig
from megatron_logra.data.synthetic import SyntheticConfig
from megatron_logra.data.tokenizer import TokenizerConfig
from megatron_logra.kl.controller import KLConfig
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.optim.config import OptimizerConfig
from megatron_logra.parallel import ParallelConfig
from megatron_logra.profiling import ProfileConfig
from megatron_logra.rewards import TaskConfig
from megatron_logra.rl.config import RLConfig, SFTConfig
from megatron_logra.sync.config import SyncConfig

__all__ = ["RunConfig"]


@dataclass
class RunConfig:
    """Everything a run needs."""

    job: str = "rl"
    """rl (warm start + LoGRA RL with KL control) or lm (next-token training on a synthetic task)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The GPT."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP layout (DP = world / (TP × PP))."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """LoGRA or dense AdamW."""
    data: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The synthetic next-token task (job=lm)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Run directory, seed, logging, checkpoints (and the lm job's loop)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """RL problems and rewards (job=rl)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer (job=rl). With ``model.hf_path`` and ``tokenizer.path`` empty, the checkpoint's; a recipe's own
    ``tokenizer.path`` (``tiny``'s) is cleared for ``model.hf_path`` unless the user sets it
    (``config.checks.resolve_hf_model``). The job refuses a tokenizer with more tokens than ``model.vocab_size``."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The RL loop (job=rl)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start before RL (job=rl)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """Predicted-KL step control (job=rl)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Policy sync to the rollout engine: sketch deltas or full refits (job=rl)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """A ``torch.profiler`` trace or an nsys capture range over a window of steps (both jobs; off by default)."""

    def __post_init__(self) -> None:
        if self.job not in ("rl", "lm"):
            raise ValueError(f"job={self.job!r}: choose rl or lm")
        self._check_sequence_shapes()
        self._check_dense_adamw()
        self._check_lr_schedule()
        if not (self.job == "rl" and self.model.hf_path):  # resolve_hf_model checks it with the checkpoint's sizes
            self.check_parallel_split()
        if self.job == "rl":
            self._check_low_precision_delta_sync()
            return
        if self.model.hf_path:
            raise ValueError(f"model.hf_path={self.model.hf_path!r} is not read by job=lm (its synthetic next-token "
                             f"task trains a model of this config from a random init): drop it (model.hf_path=) or "
                             f"use job=rl, which starts from the checkpoint")
        # the lm job's loop (the RL job's batches are rl.prompts_per_step × rl.group_size, rl.micro_batch_size)
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} must be a multiple of "
                f"train.micro_batch_size={self.train.micro_batch_size}"
            )
        if self.model.seq_length < self.data.seq_length - 1:
            raise ValueError(
                f"model.seq_length={self.model.seq_length} is shorter than the task's "
                f"{self.data.seq_length - 1} input tokens; raise model.seq_length or lower data.content_length"
            )
        if self.data.num_symbols + 2 > self.model.vocab_size:
            raise ValueError(
                f"data.num_symbols={self.data.num_symbols} needs model.vocab_size >= {self.data.num_symbols + 2}"
            )

    def check_parallel_split(self) -> None:
        """``parallel.tp`` must divide ``model.num_attention_heads``, ``num_query_groups`` and
        ``ffn_hidden_size``, ``parallel.pp`` ``model.num_layers`` (megatron-core asserts them when it builds the
        model): a ``ValueError`` naming the fields and the sizes that do (``memory.layout.check_split``). With
        ``model.hf_path`` (job=rl) it is checked once the checkpoint's architecture is read
        (``config.checks.resolve_hf_model``)."""
        from megatron_logra.memory.layout import check_split
        from megatron_logra.models.te import fp8_weight_shape_problems

        check_split(self.model, self.parallel.tp, self.parallel.pp, tp_name="parallel.tp", pp_name="parallel.pp")
        bad = fp8_weight_shape_problems(self.model, self.parallel.tp)
        if bad:
            need = ("both sides multiples of 32" if self.model.fp8_recipe == "mxfp8"
                    else "rows (out) multiples of 8 and columns (in) multiples of 16")
            raise ValueError(f"model.fp8={self.model.fp8} (model.fp8_recipe={self.model.fp8_recipe}) at parallel.tp="
                             f"{self.parallel.tp}: TransformerEngine's FP8 GEMMs need each rank's weight shard with "
                             f"{need}, but {'; '.join(bad)} (model.hidden_size, num_attention_heads, "
                             f"num_query_groups, kv_channels, ffn_hidden_size); change those sizes or set model.fp8=null")

    def _check_low_precision_delta_sync(self) -> None:
        """What sketch-delta sync cannot carry is refused before anything is built: an ``output_layer`` target
        (no engine name maps to it yet), and LoGRA with 16-bit weights, no fp32 masters and merges rounded to
        nearest (fp16, or ``logra.rounding=nearest``): a KL-controlled step lies far below the 16-bit spacing,
        so rounding each merge to nearest loses most of it for good (measured: ~8% of the intended update
        reached the weights). bf16 with ``logra.rounding=stochastic`` (the default) merges unbiasedly."""
        opt = self.optimizer
        if opt.name != "logra" or self.sync.mode != "delta":
            return
        if "output_layer" in opt.logra.targets:
            raise ValueError("optimizer.logra.targets includes output_layer, which sketch-delta sync cannot send (the "
                             "engines hold it as lm_head.weight): every update would fall back to a full refit with a "
                             "warning; set sync.mode=full, or drop output_layer from optimizer.logra.targets")
        dtype = self.model.params_dtype
        stochastic = dtype == "bfloat16" and opt.logra.rounding == "stochastic"
        if opt.logra.masters == "none" and dtype != "float32" and not stochastic:
            raise ValueError(
                f"optimizer.logra.masters=none with model.params_dtype={dtype}, optimizer.logra.rounding="
                f"{opt.logra.rounding} and sync.mode=delta: each merge would round to nearest, which loses most of "
                "each update; use bfloat16 with optimizer.logra.rounding=stochastic, set optimizer.logra.masters=fp32 "
                "(the masters keep the exact step, re-anchored at sync.max_master_drift), or sync.mode=full")

    def _check_lr_schedule(self) -> None:
        """``optimizer.schedule`` without ``decay_steps`` decays over the job's optimizer steps (``train.steps``
        for job=lm, ``rl.steps`` for job=rl): a decaying style needs them to exceed its ``warmup_steps``
        (``ValueError`` naming the fields, before anything is built)."""
        total, name = (self.train.steps, "train.steps") if self.job == "lm" else (self.rl.steps, "rl.steps")
        if total > 0:  # a run of no steps evaluates no schedule
            self.optimizer.schedule.resolve_decay_steps(total, name)

    def _check_dense_adamw(self) -> None:
        """``optimizer.name=adam`` (dense AdamW on every parameter, ``optim/dense.py``) reads neither
        ``optimizer.native.freeze`` nor (RL) ``kl.mode``: the KL controller sizes LoGRA's steps only. Either set
        to a LoGRA-only value would be silently ignored, so it is refused, naming the fields and the fix."""
        if self.optimizer.name != "adam":
            return
        ignored: list[str] = []
        if self.optimizer.native.freeze:
            ignored.append("optimizer.native.freeze=true (dense AdamW trains every parameter; set native.freeze=false)")
        if self.job == "rl" and self.kl.mode != "none":
            ignored.append(f"kl.mode={self.kl.mode} (KL step control sizes LoGRA's steps only; dense AdamW would take "
                           f"every step in full; set kl.mode=none)")
        if ignored:
            raise ValueError(f"optimizer.name=adam does not read {' or '.join(ignored)}; or keep optimizer.name=logra. "
                             f"The tiny-adam / lm-tiny-adam recipes are the dense AdamW runs of tiny / lm-tiny")

    def _check_sequence_shapes(self) -> None:
        """FP8 GEMMs and sequence parallelism constrain sequence lengths (``models.te.sequence_multiple``).

        RL packs each step's sequences to a multiple of :meth:`sequence_multiple`, capped at
        ``model.seq_length``, which must then be one too. The lm job's micro-batches are
        ``[micro_batch_size, data.seq_length - 1]``: the sequence must split over the TP group under
        sequence parallelism, and FP8 needs each rank's token count to be a multiple of 16 (32 with
        ``model.fp8_recipe=mxfp8``)."""
        from megatron_logra.models.te import fp8_token_multiple

        multiple = self.sequence_multiple()
        recipe = f", model.fp8_recipe={self.model.fp8_recipe}" if self.model.fp8 is not None else ""
        why = (f"(model.fp8={self.model.fp8}{recipe}, model.sequence_parallel={self.model.sequence_parallel}, "
               f"parallel.tp={self.parallel.tp})")
        if self.job == "rl":
            if multiple > 8 and self.model.seq_length % multiple:
                raise ValueError(f"model.seq_length={self.model.seq_length} must be a multiple of {multiple} {why}: "
                                 f"round it to {-(-self.model.seq_length // multiple) * multiple}")
            return
        s, b = self.data.seq_length - 1, self.train.micro_batch_size
        sp = self.parallel.tp if self.model.sequence_parallel and self.parallel.tp > 1 else 1
        if s % sp:
            raise ValueError(f"data.content_length={self.data.content_length}: the lm job's {s}-token sequences do "
                             f"not split over the {sp} sequence-parallel ranks {why}; turn sequence parallelism off")
        align = fp8_token_multiple(self.model.fp8_recipe)
        if self.model.fp8 is not None and (s // sp * b) % align:
            raise ValueError(f"train.micro_batch_size={b}: FP8 needs each rank's {s // sp}×{b} tokens per micro-batch "
                             f"to be a multiple of {align} {why}; use a micro-batch size that makes it one")

    def sequence_multiple(self) -> int:
        """What every packed sequence length must be a multiple of (``models.te.sequence_multiple``)."""
        from megatron_logra.models.te import sequence_multiple

        return sequence_multiple(self.model.fp8, self.model.sequence_parallel, self.parallel.tp,
                                 self.model.fp8_recipe)

    def validate(self) -> "RunConfig":
        """Re-run every component's validation, innermost first (after overrides)."""
        _validate_tree(self)
        return self


def _validate_tree(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _validate_tree(value)
    post = getattr(obj, "__post_init__", None)
    if post is not None:
        post()

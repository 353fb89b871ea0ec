"""Run configuration: each component's dataclass composed into :class:`RunConfig`, the named recipes
(:data:`RECIPES`; ``recipes_large`` registers the GPU sizes) and (de)serialisation to and from a plain dict.

:func:`from_dict` checks a saved config's values as the command line does, so the parsing of one value by
its field's annotated type (``_parse_value``, ``_coerce``, the section helpers) lives here too;
:mod:`megatron_logra.overrides` reuses it. Building a config from a recipe name or YAML file plus dotted
overrides and Megatron-LM flags is :mod:`megatron_logra.overrides`, which imports this module (never the
reverse).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_logra.data.synthetic import SyntheticConfig
from megatron_logra.data.tokenizer import TokenizerConfig
from megatron_logra.kl.controller import KLConfig
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.optim.config import LograConfig, NativeConfig, OptimizerConfig
from megatron_logra.parallel import ParallelConfig
from megatron_logra.rewards import TaskConfig
from megatron_logra.rl.config import RLConfig, RolloutConfig, SFTConfig
from megatron_logra.sync.config import SyncConfig

__all__ = ["TrainConfig", "RunConfig", "RECIPES", "to_dict", "from_dict"]


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 300
    """Optimizer steps of the lm job (Megatron-LM: --train-iters; with job=rl that flag sets rl.steps)."""
    micro_batch_size: int = 8
    """Sequences per micro-batch per rank, lm job (--micro-batch-size; job=rl: rl.micro_batch_size)."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all DP ranks, lm job (--global-batch-size; a multiple of
    micro_batch_size). RL steps train rl.prompts_per_step × rl.group_size sequences instead."""
    seed: int = 1234
    """Seed of the model init, the parallel RNGs and (RL) the warm start and rollout sampling (--seed), an int in
    [0, 2**31); the data have their own seeds: data.seed (lm job's synthetic task), task.seed / task.eval_seed
    (RL problems)."""
    log_interval: int = 10
    """Steps between log lines (--log-interval). The lm job logs every log_interval steps; the RL job only with
    train.progress=false (with the progress bar on, the bar shows each step instead and this has no effect)."""
    eval_interval: int = 50
    """Steps between held-out evaluations of the lm job; 0 disables (--eval-interval; job=rl: rl.eval_interval)."""
    eval_sequences: int = 64
    """Held-out sequences per evaluation of the lm job: eval sequences ``0 .. eval_sequences - 1``, run in
    micro-batches of micro_batch_size (the last one partly masked) spread over the DP ranks, so the held-out
    loss does not depend on the micro-batch size or the TP / PP / DP layout. 64 is what lm-tiny evaluated
    before this field existed (4 micro-batches of 16)."""
    eval_batches: Optional[int] = None
    """Deprecated (configs saved before train.eval_sequences existed hold it): when set, each evaluation runs
    eval_batches micro-batches, i.e. eval_batches × micro_batch_size sequences, a set that changes with the
    micro-batch size; train.eval_sequences is then not read. Leave it null (train.eval_batches=null) and set
    train.eval_sequences instead: giving train.eval_sequences (an override or a recipe file) while eval_batches
    is set, by the same command or in a resumed run's config, is refused until train.eval_batches=null."""
    save_interval: int = 0
    """Steps between checkpoints; 0 = only at the end (--save-interval)."""
    keep_last: int = 2
    """Checkpoints to keep."""
    checkpoint_checksums: bool = True
    """CRC-32 of every checkpoint file in meta.json, verified on load: detects a shard corrupted at
    the same size; costs about 0.3-0.5 s per GB of each rank's share at save and at load (zlib
    CRC-32). Off: sizes only are checked."""
    memory_check: str = "warn"
    """On a GPU, plan this run's per-GPU memory (the ``megatron-logra memory`` planner) against the
    device's before the model is built: ``warn`` logs the plan and warns when it does not fit,
    ``error`` refuses to start, ``off`` skips it."""
    run_dir: str = "runs/tiny"
    """Output directory: config, metrics.jsonl, checkpoints (--save); must not be empty."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir."""
    overwrite: bool = False
    """Start a new run in a run_dir that already holds one, deleting its checkpoints, metrics and
    summary. Without it such a run_dir is refused (continue it with ``--resume RUN_DIR`` instead)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    exit_signal_handler: bool = False
    """On SIGTERM (a cluster's preemption or time-limit notice; Slurm: ``#SBATCH --signal=TERM@120``),
    finish the step in flight, save its checkpoint on every rank and end normally (exit status 0,
    ``summary.json`` ``stopped``, in the RL and the LM job); after the last step the handler stays until the
    job ends (its checkpoint is saved before the final evaluation, which a SIGTERM during the save skips);
    repeats within 10 s are the same notice, a later SIGTERM ends the process at once (--exit-signal-handler).
    Off, SIGTERM ends the process at once, as torchrun expects when it stops the survivors of a failed rank."""
    exit_duration_minutes: float = 0.0
    """Stop the same way after the first step that ends this many minutes after the job started (set it
    below the scheduler's time limit minus the time a save takes); 0 = no budget (--exit-duration-in-mins)."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "log_interval", "eval_sequences", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"train.eval_batches={self.eval_batches} must be >= 1 or null (deprecated: leave it null "
                             f"and set train.eval_sequences, the held-out sequences per evaluation)")
        if self.eval_interval < 0 or self.save_interval < 0:
            raise ValueError("train.eval_interval and train.save_interval must be >= 0")
        if not isinstance(self.checkpoint_checksums, bool):
            raise ValueError(f"train.checkpoint_checksums={self.checkpoint_checksums!r} must be true or false")
        if self.memory_check not in ("off", "warn", "error"):
            raise ValueError(f"train.memory_check={self.memory_check!r}: choose off, warn or error")
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            raise ValueError(f"train.run_dir={self.run_dir!r} is empty: the run would write its checkpoints, metrics "
                             f"and config.yaml into the working directory (and train.overwrite=true would delete "
                             f"them there); name a directory, e.g. train.run_dir=runs/my-run")
        if not isinstance(self.exit_signal_handler, bool):
            raise ValueError(f"train.exit_signal_handler={self.exit_signal_handler!r} must be true or false")
        if isinstance(self.exit_duration_minutes, bool) or not isinstance(self.exit_duration_minutes, (int, float)) \
                or not math.isfinite(self.exit_duration_minutes) or self.exit_duration_minutes < 0:
            raise ValueError(f"train.exit_duration_minutes={self.exit_duration_minutes!r} must be a finite number of "
                             "minutes >= 0 (0 = no budget)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise ValueError(f"train.seed={self.seed!r} must be an int in [0, 2**31) (the seeds derived from it, "
                             "SGLang's among them, are 32-bit); choose e.g. train.seed=1234")


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
    (``overrides.resolve_hf_model``). The job refuses a tokenizer with more tokens than ``model.vocab_size``."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The RL loop (job=rl)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start before RL (job=rl)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """Predicted-KL step control (job=rl)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Policy sync to the rollout engine: sketch deltas or full refits (job=rl)."""

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
        model): a ``ValueError`` naming the fields and the sizes that do (``memory.planner.check_split``). With
        ``model.hf_path`` (job=rl) it is checked once the checkpoint's architecture is read
        (``overrides.resolve_hf_model``)."""
        from megatron_logra.memory.planner import check_split
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


# ---------------------------------------------------------------------------- recipes
WARM_START_TINY = Path(__file__).resolve().parent / "assets" / "warm_start_tiny"


def tiny() -> RunConfig:
    """Main job: tiny GPT, warm start, LoGRA RL with predicted-KL control on reasoning-gym chain_sum (CPU)."""
    shipped = (WARM_START_TINY / "model.safetensors").exists()
    return RunConfig(
        job="rl",
        model=ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=384,
                          vocab_size=160, seq_length=48),
        tokenizer=TokenizerConfig(kind="words", vocab_size=160,
                                  path=str(WARM_START_TINY / "tokenizer") if shipped else ""),
        optimizer=OptimizerConfig(
            # RowAdam at lr 1e-4 with the predicted-KL controller scaling each step; the paper recipe's fixed
            # update ratio learned about half as fast on this model (benchmarks/README.md)
            logra=LograConfig(rank=32, recipe="optimizer", lr=1e-4, weight_decay=0.0, algorithm="row_adam"),
            native=NativeConfig(freeze=True),
        ),
        task=TaskConfig(datasets=["chain_sum"],
                        dataset_kwargs={"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}},
                        num_eval=200),
        rl=RLConfig(steps=60, prompts_per_step=16, group_size=8, micro_batch_size=64, eval_interval=10,
                    prompt_template="{prompt}\n", rollout=RolloutConfig(temperature=1.0, max_new_tokens=6)),
        # a careless teacher (echoes "=" before 60% of its answers, which the verifier rejects) leaves the right
        # answer in the policy's distribution but not its mode; the shipped warm start
        # (tools/make_warm_start.py) replaces this SFT phase when present
        sft=SFTConfig(steps=1500, lr=3e-3, batch_size=64, final_lr_ratio=0.1, teacher="careless_arithmetic",
                      teacher_kwargs={"slip_rate": 0.6, "slip": "echo_equals"},
                      init_path=str(WARM_START_TINY / "model.safetensors") if shipped else ""),
        kl=KLConfig(mode="calibrated", budget_start=2e-3, budget_end=5e-4, horizon=60),
        train=TrainConfig(run_dir="runs/tiny", log_interval=5),
    )


def tiny_adam() -> RunConfig:
    """The main job with dense AdamW (no KL control), for comparison."""
    cfg = tiny()
    cfg.optimizer.name = "adam"
    cfg.optimizer.native = NativeConfig(lr=1e-4)
    cfg.kl.mode = "none"
    cfg.train.run_dir = "runs/tiny-adam"
    return cfg


def lm_tiny() -> RunConfig:
    """Tiny GPT learning a synthetic reverse task with LoGRA (RowAdam, optimizer recipe) in ~1 minute."""
    return RunConfig(
        job="lm",
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192,
                          vocab_size=32, seq_length=32),
        optimizer=OptimizerConfig(logra=LograConfig(rank=16, lr=3e-3, clip_grad=1.0),
                                  native=NativeConfig(lr=3e-3)),
        data=SyntheticConfig(task="reverse", content_length=6, num_symbols=12),
        train=TrainConfig(steps=250, micro_batch_size=16, global_batch_size=32, run_dir="runs/lm-tiny"),
    )


def lm_tiny_adam() -> RunConfig:
    """The lm-tiny recipe with dense AdamW."""
    cfg = lm_tiny()
    cfg.optimizer.name = "adam"
    cfg.train.run_dir = "runs/lm-tiny-adam"
    return cfg


RECIPES: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny, "tiny-adam": tiny_adam, "lm-tiny": lm_tiny, "lm-tiny-adam": lm_tiny_adam,
}

# GPU recipes of real sizes (qwen2.5-1.5b, qwen2.5-7b, 27b); their factories import this module lazily
from megatron_logra.recipes_large import LARGE_RECIPES  # noqa: E402

RECIPES.update(LARGE_RECIPES)


# ---------------------------------------------------------------------------- (de)serialisation
def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict, _prefix: str = "", *, validate: bool = True) -> Any:
    """Build dataclass ``cls`` from a (possibly partial) nested dict; unknown keys are errors.

    ``validate=False`` builds it without running any ``__post_init__`` check (only the fields' types are
    checked): for a saved config that command-line overrides may still fix; call ``validate()`` (or
    :func:`megatron_logra.overrides.apply_overrides`, which does) before using it.

    Values are checked against the fields' types as the dotted overrides are: strings parse like the command
    line (``"32"`` -> 32, ``"1e-4"`` -> 1e-4), other values must already have the field's type (ints widen to
    floats), and a section (a dataclass-typed field) takes a mapping, never a value. Errors are ``ValueError``
    naming the dotted field.
    """
    if not isinstance(data, dict):
        where = _prefix.rstrip(".") or "the config"
        raise ValueError(f"{where} must be a mapping of {cls.__name__} fields, got {type(data).__name__} "
                         f"{_short(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        where = f" (in {_prefix.rstrip('.')})" if _prefix else ""
        raise ValueError(f"unknown {cls.__name__} fields {unknown}{where}; known: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        ftype, path = hints[key], f"{_prefix}{key}"
        if _is_section(ftype) and isinstance(value, dict):
            kwargs[key] = from_dict(_section_type(ftype), value, f"{path}.", validate=validate)
        else:
            kwargs[key] = _coerce(value, ftype, path)
    if validate:
        return cls(**kwargs)
    obj = cls.__new__(cls)  # the fields as given, the rest at their defaults; no __post_init__
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            value = kwargs[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise ValueError(f"{_prefix}{f.name} is missing ({cls.__name__} has no default for it)")
        object.__setattr__(obj, f.name, value)
    return obj


# ---------------------------------------------------------------------------- values by annotated type
def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _section_type(ftype: Any) -> Any:
    """The dataclass of a section type (``X`` or ``Optional[X]``), else None."""
    if isinstance(ftype, type) and dataclasses.is_dataclass(ftype):
        return ftype
    if typing.get_origin(ftype) is typing.Union:
        for a in typing.get_args(ftype):
            if isinstance(a, type) and dataclasses.is_dataclass(a):
                return a
    return None


def _is_section(ftype: Any) -> bool:
    return _section_type(ftype) is not None


def _section_error(key: str, ftype: Any, value: Any) -> ValueError:
    cls = _section_type(ftype)
    fields = sorted(f.name for f in dataclasses.fields(cls))
    return ValueError(
        f"{key}={_short(value)}: {key} is a section ({cls.__name__}), not a single value; set its fields "
        f"with {key}.<field>=... (in YAML, a mapping under '{key.rsplit('.', 1)[-1]}:'); fields: {fields}"
    )


def _parse_value(raw: str, ftype: Any, key: str) -> Any:
    origin = typing.get_origin(ftype)
    args = typing.get_args(ftype)
    if origin is typing.Union and type(None) in args:
        if raw.lower() in ("none", "null", ""):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _parse_value(raw, inner, key)
    if ftype is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={raw!r} is not a boolean (use true/false)")
    if ftype is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not an integer") from None
    if ftype is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not a number") from None
    if origin in (list, Sequence) or ftype is list:
        inner = args[0] if args else str
        body = raw.strip()
        if body.startswith("[") and body.endswith("]"):  # YAML/JSON flow style: [a, b]
            body = body[1:-1]
        return [_parse_value(s.strip().strip("'\""), inner, key) for s in body.split(",") if s.strip()]
    if origin is dict or ftype is dict:
        import json

        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{key}={raw!r} is not a JSON object ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{key}={raw!r} is not a JSON object")
        return value
    return raw


def _coerce(value: Any, ftype: Any, key: str) -> Any:
    """``value`` from YAML / JSON for a field of type ``ftype``: strings parse as on the command line; other
    values must already have the field's type (ints widen to floats, 0/1 read as booleans)."""
    if _is_section(ftype):
        raise _section_error(key, ftype, value)
    if isinstance(value, str):
        return _parse_value(value, ftype, key)
    origin = typing.get_origin(ftype)
    args = typing.get_args(ftype)
    if origin is typing.Union and type(None) in args:
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(value, inner, key)
    if ftype is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{key}={_short(value)} is not a boolean (use true/false)")
    if ftype is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{key}={_short(value)} is not an integer")
    if ftype is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{key}={_short(value)} is not a number")
    if ftype is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{key}={_short(value)} is not a string (quote it in YAML)")
    if origin in (list, Sequence) or ftype is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}={_short(value)} is not a list (give [a, b] or a,b)")
        inner = args[0] if args else Any
        return [v if inner is Any else _coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or ftype is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={_short(value)} is not a mapping (give a JSON object / YAML mapping)")
        return value
    return value

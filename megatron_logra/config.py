"""Run configuration: each component's dataclass composed into :class:`RunConfig`, recipes,
dotted CLI overrides and Megatron-LM flag aliases.

Overrides take any of these forms::

    optimizer.logra.rank=64      --optimizer.logra.rank 64      --logra.rank=64
    --tensor-model-parallel-size 2   --micro-batch-size 4   --bf16

``logra.`` and ``native.`` are short for ``optimizer.logra.`` and ``optimizer.native.``.
Every value is parsed by the field's annotated type and the whole config is re-validated.

A few Megatron-LM flags set the field that the configured job reads (:func:`resolve_alias`, after
every other override, so ``job=...`` anywhere on the line counts): ``--train-iters``,
``--micro-batch-size`` and ``--eval-interval`` set ``train.*`` for ``job=lm`` and ``rl.steps``,
``rl.micro_batch_size``, ``rl.eval_interval`` for ``job=rl``; ``--global-batch-size`` is
``train.global_batch_size`` (lm) and refused for RL, whose step trains ``rl.prompts_per_step ×
rl.group_size`` sequences. The optimizer flags (``--lr``, ``--weight-decay``, ``--clip-grad``,
``--adam-beta1/2``, ``--adam-eps``) follow ``optimizer.name`` and ``logra.recipe``
(:data:`OPTIMIZER_ALIASES`); one the configured optimizer would not read is refused.
``--max-position-embeddings`` only checks ``model.seq_length`` (:data:`CHECK_FLAGS`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from megatron_logra.data.synthetic import SyntheticConfig
from megatron_logra.data.tokenizer import TokenizerConfig
from megatron_logra.kl.controller import KLConfig
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.optim.config import LograConfig, NativeConfig, OptimizerConfig
from megatron_logra.parallel import ParallelConfig
from megatron_logra.rewards import TaskConfig
from megatron_logra.rl.config import RLConfig, RolloutConfig, SFTConfig
from megatron_logra.sync.config import SyncConfig

__all__ = ["TrainConfig", "RunConfig", "RECIPES", "load_recipe", "apply_overrides", "parse_args_to_config",
           "to_dict", "from_dict", "MEGATRON_ALIASES", "JOB_ALIASES", "OPTIMIZER_ALIASES", "CHECK_FLAGS",
           "resolve_alias", "resolve_hf_model"]


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
    """Seed of the model init, the parallel RNGs and (RL) the warm start and rollout sampling (--seed); the
    data have their own seeds: data.seed (lm job's synthetic task), task.seed / task.eval_seed (RL problems)."""
    log_interval: int = 10
    """Steps between log lines (--log-interval)."""
    eval_interval: int = 50
    """Steps between held-out evaluations of the lm job; 0 disables (--eval-interval; job=rl: rl.eval_interval)."""
    eval_batches: int = 4
    """Micro-batches per evaluation (lm job)."""
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
    """Output directory: config, metrics.jsonl, checkpoints (--save)."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir."""
    overwrite: bool = False
    """Start a new run in a run_dir that already holds one, deleting its checkpoints, metrics and
    summary. Without it such a run_dir is refused (continue it with ``--resume RUN_DIR`` instead)."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "log_interval", "eval_batches", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.eval_interval < 0 or self.save_interval < 0:
            raise ValueError("train.eval_interval and train.save_interval must be >= 0")
        if not isinstance(self.checkpoint_checksums, bool):
            raise ValueError(f"train.checkpoint_checksums={self.checkpoint_checksums!r} must be true or false")
        if self.memory_check not in ("off", "warn", "error"):
            raise ValueError(f"train.memory_check={self.memory_check!r}: choose off, warn or error")


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
    """Tokenizer (job=rl)."""
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
        if self.job == "rl":
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

    def _check_sequence_shapes(self) -> None:
        """FP8 GEMMs and sequence parallelism constrain sequence lengths (``models.te.sequence_multiple``).

        RL packs each step's sequences to a multiple of :meth:`sequence_multiple`, capped at
        ``model.seq_length``, which must then be one too. The lm job's micro-batches are
        ``[micro_batch_size, data.seq_length - 1]``: the sequence must split over the TP group under
        sequence parallelism, and FP8 needs each rank's token count to be a multiple of 16."""
        multiple = self.sequence_multiple()
        why = (f"(model.fp8={self.model.fp8}, model.sequence_parallel={self.model.sequence_parallel}, "
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
        if self.model.fp8 is not None and (s // sp * b) % 16:
            raise ValueError(f"train.micro_batch_size={b}: FP8 needs each rank's {s // sp}×{b} tokens per micro-batch "
                             f"to be a multiple of 16 {why}; use a micro-batch size that makes it one")

    def sequence_multiple(self) -> int:
        """What every packed sequence length must be a multiple of (``models.te.sequence_multiple``)."""
        from megatron_logra.models.te import sequence_multiple

        return sequence_multiple(self.model.fp8, self.model.sequence_parallel, self.parallel.tp)

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


def from_dict(cls: type, data: dict, _prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a (possibly partial) nested dict; unknown keys are errors.

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
            kwargs[key] = from_dict(_section_type(ftype), value, f"{path}.")
        else:
            kwargs[key] = _coerce(value, ftype, path)
    return cls(**kwargs)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_recipe(name_or_path: str, _including: tuple = ()) -> RunConfig:
    """A named recipe or a YAML file (a partial RunConfig dict, applied over the defaults).

    A file may name its base with ``recipe: NAME_OR_FILE`` (a relative file path is relative to the file's
    own directory); its other keys are dotted sections/fields
    (``train: {steps: 3}``) parsed by the fields' types. Every problem is a ``ValueError`` naming the file.
    """
    if not isinstance(name_or_path, str):
        raise ValueError(f"recipe={_short(name_or_path)}: give a recipe name ({', '.join(sorted(RECIPES))}) "
                         "or a .yaml file")
    if name_or_path in RECIPES:
        return RECIPES[name_or_path]()
    path = Path(name_or_path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"unknown recipe {name_or_path!r}: choose one of {sorted(RECIPES)} or a .yaml file")
    if not path.exists():
        raise ValueError(f"recipe file {path} does not exist (check the path; named recipes: {sorted(RECIPES)})")
    if not path.is_file():
        raise ValueError(f"recipe file {path} is not a file")
    resolved = path.resolve()
    if resolved in _including:
        chain = " -> ".join(str(p) for p in (*_including, resolved))
        raise ValueError(f"recipe file {path} includes itself through 'recipe:' ({chain}); break the cycle")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read recipe file {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"recipe file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(
            f"recipe file {path}: the top level must be a mapping of config sections and fields "
            f"(e.g. 'recipe: tiny' / 'train:' / 'rl:'), got a {type(data).__name__} {_short(data)}"
        )
    data = dict(data)
    base = data.pop("recipe", None)
    if base is not None and not isinstance(base, str):
        raise ValueError(f"recipe file {path}: recipe={_short(base)} must be a recipe name "
                         f"({', '.join(sorted(RECIPES))}) or a .yaml file")
    if base and base not in RECIPES and not Path(base).is_absolute():
        base = str(path.parent / base)  # a file names its base relative to itself, not to the working directory
    try:
        cfg = load_recipe(base, (*_including, resolved)) if base else RunConfig()
        return _apply_items(cfg, _flatten(data))[0].validate()
    except ValueError as exc:
        raise ValueError(f"recipe file {path}: {exc}") from None


def _yaml_problem(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested YAML sections -> (dotted key, value); a mapping given to a dict-typed field stays whole."""
    out = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        ftype = _field_type(key)
        if isinstance(v, dict) and not _is_mapping_type(ftype) and (v or _is_section(ftype)):
            out.extend(_flatten(v, f"{key}."))  # an empty section ("rl: {}") changes nothing
        else:
            out.append((key, v))
    return out


def _field_type(key: str) -> Any:
    """The annotated type of dotted ``key`` in :class:`RunConfig` (shortcuts and aliases applied), or None."""
    key = _expand(MEGATRON_ALIASES.get(key, key))
    cls: Any = RunConfig
    ftype: Any = None
    for part in key.split("."):
        if not _is_section(cls):
            return None
        hints = typing.get_type_hints(_section_type(cls))
        if part not in hints:
            return None
        ftype = cls = hints[part]
    return ftype


def _is_mapping_type(ftype: Any) -> bool:
    if typing.get_origin(ftype) is typing.Union:
        return any(_is_mapping_type(a) for a in typing.get_args(ftype))
    return ftype is dict or typing.get_origin(ftype) is dict


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


# ---------------------------------------------------------------------------- overrides
MEGATRON_ALIASES: dict[str, str] = {
    "tensor-model-parallel-size": "parallel.tp",
    "pipeline-model-parallel-size": "parallel.pp",
    "seq-length": "model.seq_length",
    "num-layers": "model.num_layers",
    "hidden-size": "model.hidden_size",
    "ffn-hidden-size": "model.ffn_hidden_size",
    "num-attention-heads": "model.num_attention_heads",
    "kv-channels": "model.kv_channels",
    "num-query-groups": "model.num_query_groups",
    "init-method-std": "model.init_std",
    "hidden-dropout": "model.hidden_dropout",
    "attention-dropout": "model.attention_dropout",
    "rotary-base": "model.rotary_base",
    "normalization": "model.normalization",
    "norm-epsilon": "model.layernorm_epsilon",
    "recompute-granularity": "model.recompute",
    "make-vocab-size-divisible-by": "model.make_vocab_size_divisible_by",
    "transformer-impl": "model.transformer_impl",
    "fp8-format": "model.fp8",
    "fp8-recipe": "model.fp8_recipe",
    "seed": "train.seed",
    "log-interval": "train.log_interval",
    "save-interval": "train.save_interval",
    "save": "train.run_dir",
    "optimizer": "optimizer.name",
}
"""Megatron-LM flags (without ``--``) -> the dotted field they set, whatever the job; the flags of
:data:`JOB_ALIASES` are resolved against the configured job by :func:`resolve_alias`."""

JOB_ALIASES: dict[str, dict[str, Optional[str]]] = {
    "train-iters": {"lm": "train.steps", "rl": "rl.steps"},
    "micro-batch-size": {"lm": "train.micro_batch_size", "rl": "rl.micro_batch_size"},
    "global-batch-size": {"lm": "train.global_batch_size", "rl": None},
    "eval-interval": {"lm": "train.eval_interval", "rl": "rl.eval_interval"},
}
"""Megatron-LM flags whose field depends on ``job``: the lm job's loop reads ``train.*``, the RL job
``rl.*`` (None: no RL field; the flag is refused)."""

OPTIMIZER_ALIASES: tuple[str, ...] = ("lr", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps")
"""Megatron-LM optimizer flags, resolved against ``optimizer.name`` / ``logra.recipe`` /
``native.freeze`` (:func:`resolve_alias`):

* ``optimizer.name=adam`` (dense AdamW reads ``optimizer.native.*``): ``--lr``, ``--weight-decay``,
  ``--adam-beta1/2``, ``--adam-eps`` set ``optimizer.native.*``; ``--clip-grad`` ``optimizer.logra.clip_grad``.
* LoGRA, ``logra.recipe=optimizer``: ``--lr``, ``--weight-decay``, ``--clip-grad`` set ``optimizer.logra.*``
  (the target layers; ``native.lr`` etc. stay for the other parameters); ``--adam-*`` set the AdamW of the
  non-target parameters, ``optimizer.native.*``, refused when ``native.freeze=true`` freezes them.
* LoGRA, ``logra.recipe=paper``: ``--lr``, ``--weight-decay`` and ``--clip-grad`` are refused (its step is
  ``logra.update_ratio`` scaled by the KL controller's α, without weight decay on targets or clipping)."""

CHECK_FLAGS: tuple[str, ...] = ("max-position-embeddings",)
"""Megatron-LM flags without a field of their own, accepted as a check (:func:`_check_flag`):
``--max-position-embeddings N`` needs ``N >= model.seq_length`` (positions run up to ``model.seq_length``;
RoPE has no position table) and, with learned absolute positions (a table of ``model.seq_length`` rows),
``N == model.seq_length``. It never changes ``model.seq_length`` (``--seq-length``)."""

_CONTEXT_FLAGS = frozenset(JOB_ALIASES) | frozenset(OPTIMIZER_ALIASES) | frozenset(CHECK_FLAGS)
"""Flags set by :func:`resolve_alias`, after the other overrides."""

# Megatron-LM boolean flags (no value) -> (dotted key, value)
MEGATRON_FLAGS: dict[str, tuple[str, str]] = {
    "bf16": ("model.params_dtype", "bfloat16"),
    "fp16": ("model.params_dtype", "float16"),
    "swiglu": ("model.swiglu", "true"),
    "untie-embeddings-and-output-weights": ("model.untie_embeddings_and_output_weights", "true"),
    "add-qkv-bias": ("model.add_qkv_bias", "true"),
    "add-bias-linear": ("model.add_bias_linear", "true"),
    "disable-bias-linear": ("model.add_bias_linear", "false"),
    "qk-layernorm": ("model.qk_layernorm", "true"),
    "sequence-parallel": ("model.sequence_parallel", "true"),
    "resume": ("train.resume", "true"),
}

_SHORTCUTS = {"logra.": "optimizer.logra.", "native.": "optimizer.native."}


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


def _expand(key: str) -> str:
    for short, full in _SHORTCUTS.items():
        if key.startswith(short):
            return full + key[len(short):]
        if key == short[:-1]:  # the section itself ("logra" -> "optimizer.logra")
            return full[:-1]
    return key


def set_dotted(cfg: Any, key: str, raw: Any) -> None:
    """Set ``cfg.<key>`` from ``raw`` (a command-line string, or a YAML value), parsed by the field's type."""
    key = _expand(key)
    parts = key.replace("-", "_").split(".")
    key = ".".join(parts)
    obj = cfg
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(obj):
            raise ValueError(f"unknown config key {key!r}: {'.'.join(parts[:i])} is not a section")
        names = {f.name for f in dataclasses.fields(obj)}
        if part not in names:
            where = ".".join(parts[:i]) or "the run config"
            raise ValueError(f"unknown config key {key!r}: {where} has no field {part!r}; known: {sorted(names)}")
        if i == len(parts) - 1:
            ftype = typing.get_type_hints(type(obj))[part]
            setattr(obj, part, _coerce(raw, ftype, key))
        else:
            obj = getattr(obj, part)


def _canonical(key: str) -> str:
    """The dotted field ``key`` names, as :func:`set_dotted` spells it (shortcuts expanded, ``-`` -> ``_``)."""
    return _expand(key).replace("-", "_")


def resolve_alias(cfg: RunConfig, flag: str) -> str:
    """The dotted field that the context-dependent Megatron-LM flag ``flag`` (without ``--``) sets in
    ``cfg``; a ``ValueError`` naming the field to use instead when the flag would have no effect."""
    if flag in JOB_ALIASES:
        target = JOB_ALIASES[flag].get(cfg.job)
        if target is None:
            rl = cfg.rl
            raise ValueError(
                f"--{flag} has no field in the RL job (job=rl): each RL step trains rl.prompts_per_step × "
                f"rl.group_size = {rl.prompts_per_step} × {rl.group_size} = {rl.prompts_per_step * rl.group_size} "
                f"sequences (in micro-batches of rl.micro_batch_size); set rl.prompts_per_step (and rl.group_size) "
                f"instead")
        return target
    if flag in OPTIMIZER_ALIASES:
        return _optimizer_alias(cfg, flag)
    raise ValueError(f"--{flag} is not a context-dependent flag")


_NATIVE_FIELDS = {"lr": "lr", "weight-decay": "weight_decay", "adam-beta1": "beta1", "adam-beta2": "beta2",
                  "adam-eps": "eps"}


def _optimizer_alias(cfg: RunConfig, flag: str) -> str:
    """See :data:`OPTIMIZER_ALIASES`."""
    opt = cfg.optimizer
    if opt.name == "adam":  # dense AdamW (optim/dense.py): native.* for every parameter, logra.clip_grad
        return "optimizer.logra.clip_grad" if flag == "clip-grad" else f"optimizer.native.{_NATIVE_FIELDS[flag]}"
    if flag in ("lr", "weight-decay", "clip-grad"):
        field = {"lr": "lr", "weight-decay": "weight_decay", "clip-grad": "clip_grad"}[flag]
        if opt.logra.recipe == "paper":
            why, instead = {
                "lr": ("its step is logra.update_ratio scaled by the KL controller's α",
                       "set logra.update_ratio (and native.lr for non-target parameters) or use logra.recipe=optimizer"),
                "weight-decay": ("it applies no weight decay to the target layers",
                                 "set native.weight_decay for non-target parameters or use logra.recipe=optimizer"),
                "clip-grad": ("it does not clip: the KL controller's α bounds each step",
                              "use logra.recipe=optimizer to clip"),
            }[flag]
            raise ValueError(f"--{flag} would set optimizer.logra.{field}, which logra.recipe=paper does not use "
                             f"({why}); {instead}")
        return f"optimizer.logra.{field}"
    field = _NATIVE_FIELDS[flag]
    if opt.native.freeze:
        instead = {"beta1": "LoGRA's RowAdam has no first moment",
                   "beta2": "LoGRA's RowAdam decay is optimizer.logra.beta2",
                   "eps": "LoGRA's RowAdam epsilon is optimizer.logra.eps"}[field]
        raise ValueError(f"--{flag} would set optimizer.native.{field}, the AdamW of the non-target parameters, "
                         f"which optimizer.native.freeze=true freezes: it has no effect; {instead} (or set "
                         f"native.freeze=false)")
    return f"optimizer.native.{field}"


def _check_flag(cfg: RunConfig, flag: str, raw: Any) -> None:
    """See :data:`CHECK_FLAGS`."""
    value = _coerce(raw, int, f"--{flag}")
    seq, kind = cfg.model.seq_length, cfg.model.position_embedding_type
    if value < seq:
        raise ValueError(f"--{flag}={value} is below model.seq_length={seq}: positions run up to model.seq_length "
                         f"(there is no separate position limit); set --seq-length / model.seq_length to at most "
                         f"{value} or raise --{flag}")
    if kind == "learned_absolute" and value != seq:
        raise ValueError(f"--{flag}={value}: model.position_embedding_type=learned_absolute has a table of "
                         f"model.seq_length={seq} positions; set --seq-length {value} to size it (or drop --{flag})")


def _apply_items(cfg: RunConfig, items: Sequence[tuple[str, Any]]) -> tuple[RunConfig, set[str]]:
    """Set ``(key, value)`` pairs in order (a key may be a Megatron-LM flag name), then the flags whose
    field depends on the rest of the config (:func:`resolve_alias`) against the config they leave.
    Returns the config and the dotted fields set."""
    deferred: list[tuple[str, Any]] = []
    given: set[str] = set()
    for key, raw in items:
        if key in _CONTEXT_FLAGS:
            deferred.append((key, raw))
            continue
        key = MEGATRON_ALIASES.get(key, key)
        set_dotted(cfg, key, raw)
        given.add(_canonical(key))
    for flag, raw in deferred:
        if flag in CHECK_FLAGS:
            _check_flag(cfg, flag, raw)
            continue
        target = resolve_alias(cfg, flag)
        if target in given:
            raise ValueError(f"--{flag} sets {target} here, which is also given: give only one of them")
        set_dotted(cfg, target, raw)
        given.add(target)
    return cfg, given


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """Apply dotted overrides and Megatron-LM flags (see module docstring), then validate."""
    items: list[tuple[str, Any]] = []
    pending = list(overrides)
    i = 0
    while i < len(pending):
        item = pending[i]
        i += 1
        if item.startswith("--"):
            body = item[2:]
            if "=" in body:
                key, raw = body.split("=", 1)
            elif body in MEGATRON_FLAGS:
                items.append(MEGATRON_FLAGS[body])
                continue
            else:
                if i >= len(pending):
                    raise ValueError(f"option {item} needs a value")
                key, raw = body, pending[i]
                i += 1
        elif "=" in item:
            key, raw = item.split("=", 1)
        else:
            raise ValueError(f"cannot parse override {item!r}: use key=value or --key value")
        items.append((key, raw))
    cfg, given = _apply_items(cfg, items)
    return resolve_hf_model(cfg.validate(), given)


def resolve_hf_model(cfg: RunConfig, given: Sequence[str] = ()) -> RunConfig:
    """With ``model.hf_path`` (job=rl), the checkpoint's architecture replaces the config's, as the RL job
    does when it starts (``convert.model_config_from_hf``; the run's own choices, such as ``seq_length`` and
    the dtype, stay): a missing or unreadable checkpoint is a ``ValueError`` naming ``model.hf_path``, and so is
    an architecture field among ``given`` (fields set by the overrides) that the checkpoint would replace."""
    if cfg.job != "rl" or not cfg.model.hf_path:
        return cfg
    from megatron_logra.convert.spec import ARCH_FIELDS, model_config_from_hf

    mine = cfg.model
    cfg.model = model_config_from_hf(mine.hf_path, base=mine)
    replaced = [f"model.{k}={getattr(mine, k)!r} (the checkpoint has {getattr(cfg.model, k)!r})"
                for k in ARCH_FIELDS if f"model.{k}" in given and getattr(mine, k) != getattr(cfg.model, k)]
    if replaced:
        raise ValueError(f"{'; '.join(replaced)}: the architecture comes from model.hf_path={mine.hf_path!r}; drop "
                         f"the override or start from another checkpoint")
    return cfg.validate()


def parse_args_to_config(recipe: Optional[str], overrides: Sequence[str]) -> RunConfig:
    """Recipe (default ``tiny``) plus overrides."""
    return apply_overrides(load_recipe(recipe or "tiny"), overrides)

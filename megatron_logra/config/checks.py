"""Cross-field checks of the fields a user gave (``given``: dotted field -> where it was set, ``""`` for the
command line, ``"recipe file PATH"`` for a recipe file), run by :mod:`megatron_logra.config.overrides` after
the overrides: a field the configured job or LoGRA recipe would silently ignore, a LoGRA rank above a
target's input width; and :func:`resolve_hf_model`, which takes ``model.hf_path``'s architecture and refuses
a given architecture field the checkpoint would replace. Values of a named recipe or a resumed run's saved
config are not "given": only :class:`~megatron_logra.config.run.RunConfig`'s own validation checks them."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Mapping, Sequence, Union

from megatron_logra.config.codec import _short
from megatron_logra.config.run import RunConfig
from megatron_logra.optim.config import LograConfig

logger = logging.getLogger(__name__)

__all__ = ["resolve_hf_model"]


_RANK_INPUTS = frozenset({"optimizer.name", "optimizer.logra.rank", "optimizer.logra.targets", "model.hidden_size",
                          "model.ffn_hidden_size", "model.num_attention_heads", "model.kv_channels"})
"""The fields that decide whether ``optimizer.logra.rank`` fits the targets (:func:`_check_logra_rank`)."""


def _check_logra_rank(cfg: RunConfig, given: Mapping[str, str]) -> None:
    """With LoGRA (``optimizer.name=logra``) and one of :data:`_RANK_INPUTS` among ``given`` (set by an override
    or a recipe file), ``optimizer.logra.rank`` above the input width of a target layer is a ``ValueError`` naming
    the field, the target and the model field that sizes it, before anything is built. Otherwise (a named
    recipe's rank against a ``model.hf_path`` checkpoint's shapes, a target named by an exact leaf module name
    other than ``output_layer``) the sketches refuse it, naming ``optimizer.logra.rank``, when installed."""
    from megatron_logra.sketch.naming import TARGET_ALIASES

    if cfg.optimizer.name != "logra" or not _RANK_INPUTS & set(given):
        return
    m = cfg.model
    widths = {"linear_qkv": (m.hidden_size, "model.hidden_size"),
              "linear_proj": (m.num_attention_heads * m.head_dim, "model.num_attention_heads × the head dim"),
              "linear_fc1": (m.hidden_size, "model.hidden_size"),
              "linear_fc2": (m.ffn_hidden_size, "model.ffn_hidden_size"),
              "output_layer": (m.hidden_size, "model.hidden_size")}
    rank = cfg.optimizer.logra.rank
    checked = [(*widths[kind], target) for target in cfg.optimizer.logra.targets
               if (kind := TARGET_ALIASES.get(target, target)) in widths]
    if checked and rank > min(checked)[0]:
        width, what, target = min(checked)
        raise ValueError(f"optimizer.logra.rank={rank} exceeds the input width {width} ({what}) of the LoGRA target "
                         f"{target}: the sketch rank is at most the input width of every target; set "
                         f"optimizer.logra.rank <= {width} (logra.rank={width})")


_PAPER_UNUSED: dict[str, tuple[str, str]] = {
    "lr": ("its step is optimizer.logra.update_ratio scaled by the KL controller's α",
           " (optimizer.logra.update_ratio sizes the targets' step, optimizer.native.lr the other parameters')"),
    "weight_decay": ("it applies no weight decay to the target layers",
                     " (optimizer.native.weight_decay decays the non-target parameters)"),
    "clip_grad": ("it does not clip: the KL controller's α bounds each step", ""),
}
"""Fields of ``optimizer.logra`` that ``recipe=paper`` does not read: (why, what to do instead)."""


def _check_paper_unused(cfg: RunConfig, given: Mapping[str, str]) -> None:
    """With ``optimizer.logra.recipe=paper`` (LoGRA), an ``optimizer.logra.lr`` / ``weight_decay`` /
    ``clip_grad`` the user gave (``given``: an override or a recipe file's field) at a value other than the
    field's default would be silently ignored: refused, naming it, as the ``--lr`` / ``--weight-decay`` /
    ``--clip-grad`` flags are. Values of a named recipe or a resumed run's saved config are not "given"."""
    opt = cfg.optimizer
    if opt.name != "logra" or opt.logra.recipe != "paper":
        return
    defaults = LograConfig()
    for name, (why, hint) in _PAPER_UNUSED.items():
        key = f"optimizer.logra.{name}"
        value = getattr(opt.logra, name)
        if key in given and value != getattr(defaults, name):
            where = f" in {given[key]}" if given[key] else ""
            raise ValueError(f"{key}={value} is set{where}, but optimizer.logra.recipe=paper does not use it ({why}); "
                             f"remove {key}{hint}, or use optimizer.logra.recipe=optimizer")


_LM_ONLY: dict[str, str] = {
    "train.steps": "the RL job runs rl.steps",
    "train.micro_batch_size": "the RL job's micro-batch is rl.micro_batch_size",
    "train.global_batch_size": "each RL step trains rl.prompts_per_step × rl.group_size sequences",
    "train.eval_interval": "the RL job evaluates every rl.eval_interval steps",
    "train.eval_sequences": "the RL job evaluates task.num_eval held-out problems",
    "train.eval_batches": "the RL job evaluates task.num_eval held-out problems",
    "data.": "the RL job's problems are task.*",
}
"""Fields (``data.``: the section) only the lm job reads, with what the RL job reads instead."""

_RL_ONLY: dict[str, str] = {
    "rl.steps": "the lm job runs train.steps",
    "rl.micro_batch_size": "the lm job's micro-batch is train.micro_batch_size",
    "rl.eval_interval": "the lm job evaluates every train.eval_interval steps",
    "rl.": "the lm job's loop is train.*",
    "task.": "the lm job's synthetic task is data.*",
    "sft.": "the lm job has no warm start",
    "kl.": "the lm job has no KL step control",
    "sync.": "the lm job has no rollout engine to sync",
    "tokenizer.": "the lm job's synthetic task has no tokenizer",
}
"""Fields (a key ending in ``.``: the section) only the RL job reads, with what the lm job reads instead."""


def _check_other_job_unused(cfg: RunConfig, given: Mapping[str, str]) -> None:
    """A field the user gave (``given``: an override or a recipe file's field) at a value other than the
    field's default that the configured job never reads (the lm job's ``train.steps`` etc. with job=rl, the RL
    sections with job=lm) would be silently ignored: refused, naming the field and the job's own. Values of a
    named recipe or a resumed run's saved config are not "given"."""
    unused = _LM_ONLY if cfg.job == "rl" else _RL_ONLY
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    for key in sorted(given):
        why = unused.get(key) or next((w for k, w in unused.items() if k.endswith(".") and key.startswith(k)), None)
        if why is None:
            continue
        first, *rest = key.split(".")
        value, default = getattr(cfg, first), sections[first].default_factory()  # the section's defaults
        for part in rest:
            value, default = getattr(value, part), getattr(default, part)
        if value == default:
            continue
        where = f" in {given[key]}" if given[key] else ""
        raise ValueError(f"{key}={_short(value)} is set{where}, but the {cfg.job} job does not read it ({key} is the "
                         f"{'lm' if cfg.job == 'rl' else 'RL'} job's; {why}); remove {key}")


def _warn_log_interval_unread(cfg: RunConfig, given: Mapping[str, str]) -> None:
    """``train.log_interval`` (``--log-interval``) given for the RL job while ``train.progress`` is on: the RL
    loop then shows each step on its progress bar and writes no log lines, so the interval has no effect; a
    warning says so and how to get the lines (``train.progress=false``). A warning, not an error: a pasted
    Megatron-LM launch line holds ``--log-interval`` whatever the job. A recipe file that states
    ``train.progress`` as well has chosen the bar with its interval: a whole config (a run's ``config.yaml``,
    ``megatron-logra config RECIPE > FILE``) states every field."""
    if cfg.job != "rl" or not cfg.train.progress or "train.log_interval" not in given:
        return
    source = given["train.log_interval"]
    if source and given.get("train.progress") == source:
        return
    where = f" (in {given['train.log_interval']})" if given["train.log_interval"] else ""
    logger.warning("train.log_interval=%d (--log-interval)%s has no effect here: the RL job shows each step on its "
                   "progress bar and writes log lines only with train.progress=false; give train.progress=false for "
                   "a log line every %d steps (every step's record is in RUN/metrics.jsonl either way)",
                   cfg.train.log_interval, where, cfg.train.log_interval)


def resolve_hf_model(cfg: RunConfig, given: Union[Sequence[str], Mapping[str, str]] = (), *,
                     from_recipe: bool = False) -> RunConfig:
    """With ``model.hf_path`` (job=rl), the checkpoint's architecture replaces the config's, as the RL job
    does when it starts (``convert.model_config_from_hf``; the run's own choices, such as ``seq_length`` and
    the dtype, stay): a missing or unreadable checkpoint is a ``ValueError`` naming ``model.hf_path``, and so is
    an architecture field among ``given`` (fields set by the overrides or a recipe file; a mapping names where
    each was set, e.g. ``"recipe file x.yaml"``, ``""`` for the command line) that the checkpoint would replace.

    The checkpoint brings its tokenizer too: with ``from_recipe`` (the fields not in ``given`` are a named
    recipe's, as for ``megatron-logra train RECIPE``), a ``tokenizer.path`` not in ``given`` (the ``tiny``
    recipe's own word tokenizer) is cleared, so the RL job loads the tokenizer of ``model.hf_path``; one the
    user gave (an override or a recipe file's field) stays. Without ``from_recipe`` (a resumed run's saved
    config) ``tokenizer.path`` is left as it is."""
    if cfg.job != "rl" or not cfg.model.hf_path:
        return cfg
    run_dir, hf_dir = Path(cfg.train.run_dir).expanduser().resolve(), Path(cfg.model.hf_path).expanduser().resolve()
    if run_dir == hf_dir:
        raise ValueError(f"train.run_dir={cfg.train.run_dir!r} is the directory of model.hf_path={cfg.model.hf_path!r}: "
                         f"the run's checkpoints, metrics and config would land among the checkpoint's files; give "
                         f"the run a directory of its own (e.g. train.run_dir=runs/{hf_dir.name})")
    if from_recipe and cfg.tokenizer.path and "tokenizer.path" not in given:
        cfg.tokenizer.path = ""
    from megatron_logra.convert.hf_config import ARCH_FIELDS, model_config_from_hf

    where = given if isinstance(given, Mapping) else dict.fromkeys(given, "")
    mine = cfg.model
    cfg.model = model_config_from_hf(mine.hf_path, base=mine)
    replaced = []
    for k in ARCH_FIELDS:
        source = where.get(f"model.{k}")
        if source is not None and getattr(mine, k) != getattr(cfg.model, k):
            replaced.append(f"model.{k}={getattr(mine, k)!r} ({f'set in {source}; ' if source else ''}the checkpoint "
                            f"has {getattr(cfg.model, k)!r})")
    if replaced:
        raise ValueError(f"{'; '.join(replaced)}: the architecture comes from model.hf_path={mine.hf_path!r}; drop "
                         f"the override (or the recipe file's field) or start from another checkpoint")
    cfg.check_parallel_split()  # RunConfig's own check waits for the checkpoint's sizes
    return cfg.validate()

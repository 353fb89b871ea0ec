"""Memory preflight of a training run: the planner's verdict for *this* run, before the model is built.

``megatron-logra memory`` answers "will it fit?" for a configuration typed on the command line;
:func:`run_plan_config` derives that configuration from a run's own config (model, parallel layout,
optimizer, batch shape, recompute, attention kernels, rollout engine), and :func:`memory_preflight`
plans it against the GPU the run is on (``train.memory_check``): the plan is logged, and a run the
planner says does not fit gets a warning -- or, with ``train.memory_check=error``, a clear error --
before minutes of model building and checkpoint loading end in an out-of-memory crash.

What the run's config maps to (see :class:`~megatron_logra.memory.plan_config.PlanConfig`):

* micro-batch: the sequences the trainer really puts in one micro-batch x ``model.seq_length`` (RL) or
  ``train.micro_batch_size`` x ``data.seq_length - 1`` (LM: the task's input tokens). An RL step splits
  each DP rank's ``rl.prompts_per_step / dp x rl.group_size`` sequences (and a supervised warm start's
  ``sft.batch_size / dp`` demonstrations) into micro-batches of ``rl.micro_batch_size``, so a micro-batch
  holds ``min(rl.micro_batch_size, those rows)`` (:func:`rl_micro_batch`); an LM micro-batch always holds
  ``train.micro_batch_size`` (``train.global_batch_size`` is a multiple of it times DP);
* attention ``flash`` with TransformerEngine layers, else megatron's unfused attention;
* the colocated engine: an in-process SGLang engine reserves ``rl.rollout.mem_fraction_static`` (its KV
  cache included); the embedded engine keeps a whole (un-sharded) copy of the model in
  ``model.params_dtype`` on the trainer's GPU and, while it generates, the KV cache of one ``generate()``
  batch (:func:`embedded_rollout_sequences` sequences of up to ``model.seq_length`` tokens); a separate
  SGLang server (``rl.rollout.sglang_url``) takes nothing here;
* dense AdamW keeps its full states on every DP rank (``distributed_optimizer=False``: this trainer
  does not shard them), log-probs in ``rl.loss.logprob_chunk_tokens`` chunks (LM: megatron's
  cross entropy over the whole logits, ``loss="lm"``);
* LoGRA: the configured ``optimizer.logra.targets``; ``optimizer.native.freeze`` leaves the non-targets
  without grads, masters and AdamW state (``freeze_native``); their AdamW step is scaled by the step
  size (a copy of their masters during the step) in an RL run with ``kl.mode`` other than none and
  ``logra.scale_native`` (``scaled_native_step``);
* policy-sync temporaries only for RL (the LM job has no rollout engine to sync: ``policy_sync=False``);
* a KL penalty (``rl.loss.kl_coef > 0``) keeps a frozen reference model: its weights once more.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megatron_logra.memory.breakdown import MemoryPlan
from megatron_logra.memory.plan_config import OPTIMIZERS, PlanConfig
from megatron_logra.memory.planner import plan
from megatron_logra.memory.report import layout_text, verdict_line
from megatron_logra.memory.units import format_bytes
from megatron_logra.models.te import te_unavailable_reason

logger = logging.getLogger(__name__)

__all__ = ["attention_kernel", "rl_micro_batch", "embedded_rollout_sequences", "run_plan_config",
           "memory_preflight", "unmodelled", "fit_hint", "MemoryCheckError"]

class MemoryCheckError(ValueError):
    """The planner says this run does not fit its GPU and ``train.memory_check=error`` (bad input:
    the command line reports it without a traceback)."""


def _engine_fraction(cfg: Any, gpu_memory_bytes: int) -> float:
    if cfg.job != "rl":
        return 0.0
    ro = cfg.rl.rollout
    if ro.engine == "sglang":
        return 0.0 if ro.sglang_url else float(ro.mem_fraction_static)
    copy = cfg.model.num_params() * cfg.model.torch_dtype.itemsize
    return min(copy / gpu_memory_bytes, 0.99)


def rl_micro_batch(cfg: Any, dp: int) -> int:
    """Sequences in the largest micro-batch of RL run ``cfg`` on one of ``dp`` data-parallel ranks:
    ``rl.micro_batch_size``, or fewer when a rank has fewer rows per step to split (its
    ``rl.prompts_per_step / dp x rl.group_size`` rollouts; a supervised warm start that trains, its
    ``sft.batch_size / dp`` demonstrations), as ``rl.batching.split_microbatches`` cuts them. With
    ``rl.max_tokens_per_micro_batch`` an RL step's micro-batch holds at most that many positions, or one
    sequence (a warm start's micro-batches too): planned as the budget's worth of ``model.seq_length`` sequences,
    rounded up."""
    budget = cfg.rl.max_tokens_per_micro_batch
    per_micro = max(1, -(-budget // cfg.model.seq_length)) if budget else cfg.rl.micro_batch_size
    rows = -(-cfg.rl.prompts_per_step // dp) * cfg.rl.group_size
    if cfg.sft.steps > 0 and not cfg.model.hf_path and not cfg.sft.init_path:  # the warm start trains
        rows = max(rows, -(-cfg.sft.batch_size // dp))
    return min(per_micro, rows)


def embedded_rollout_sequences(cfg: Any, dp: int) -> int:
    """Sequences one ``generate()`` call of an embedded rollout engine holds on one of ``dp`` data-parallel
    ranks (0 without one): a training step's ``rl.prompts_per_step / dp x rl.group_size``, or an
    evaluation's ``task.num_eval / dp x rl.rollout.eval_samples`` when evaluations run, whichever is larger."""
    if cfg.job != "rl" or cfg.rl.rollout.engine != "embedded":
        return 0
    rows = -(-cfg.rl.prompts_per_step // dp) * cfg.rl.group_size
    if cfg.rl.eval_interval > 0 and cfg.task.num_eval > 0:
        rows = max(rows, -(-cfg.task.num_eval // dp) * cfg.rl.rollout.eval_samples)
    return rows


def attention_kernel(model: Any) -> str:
    """The attention the planner should model for ``model`` (a ``ModelConfig``) built on this machine:
    ``flash`` where its layers are TransformerEngine's (fused attention) in 16-bit, else ``unfused``:
    megatron's local spec always, and TransformerEngine too for ``float32`` parameters (its flash and fused
    backends take fp16/bf16 only, so it falls back to its unfused attention, which keeps the s x s scores)."""
    impl = model.transformer_impl
    te = impl == "transformer_engine" or (impl == "auto" and te_unavailable_reason() is None)
    return "flash" if te and model.params_dtype != "float32" else "unfused"


def run_plan_config(cfg: Any, *, tp: int, pp: int, dp: int, gpu_memory_bytes: int) -> Optional[PlanConfig]:
    """The planner's configuration of run config ``cfg`` at this layout and GPU size (None for an
    optimizer the planner does not model)."""
    name = cfg.optimizer.name
    if name not in OPTIMIZERS:
        return None
    rl = cfg.job == "rl"
    logra = name == "logra"
    return PlanConfig(
        tp=tp, pp=pp, dp=dp, optimizer=name, rank=cfg.optimizer.logra.rank, masters=cfg.optimizer.logra.masters,
        micro_batch=rl_micro_batch(cfg, dp) if rl else cfg.train.micro_batch_size,
        seq_len=cfg.model.seq_length if rl else cfg.data.seq_length - 1,  # LM micro-batches: [mbs, data.seq_length - 1]
        recompute=cfg.model.recompute, gpu_memory_bytes=int(gpu_memory_bytes),
        engine_fraction=_engine_fraction(cfg, gpu_memory_bytes), rollout_sequences=embedded_rollout_sequences(cfg, dp),
        distributed_optimizer=False,
        attention=attention_kernel(cfg.model), cache_projections=cfg.optimizer.logra.cache_projections,
        logprob_chunk_tokens=cfg.rl.loss.logprob_chunk_tokens if rl else 0,
        loss="logprob" if rl else "lm", policy_sync=rl, reference_model=rl and cfg.rl.loss.kl_coef > 0,
        targets=tuple(cfg.optimizer.logra.targets), freeze_native=logra and cfg.optimizer.native.freeze,
        scaled_native_step=rl and cfg.kl.mode != "none" and cfg.optimizer.logra.scale_native,
    )


def unmodelled(cfg: Any) -> list[str]:
    """Parts of run ``cfg`` the planner leaves out (named in the preflight's log line)."""
    out = []
    if cfg.model.fp8:
        out.append("fp8 (TE's scaling state and fp8 weight copies)")
    if cfg.model.sequence_parallel:
        out.append("sequence parallelism (activations counted unsharded)")
    return out


def fit_hint(cfg: Any, pcfg: PlanConfig) -> str:
    """What could make run ``cfg`` (planned as ``pcfg``) fit: only changes it has not made already (a
    micro-batch above 1, recompute not yet full, a rank above 1, an engine share above 0, ...), then where
    to plan alternatives and how to skip the check."""
    rl = cfg.job == "rl"
    options: list[str] = []
    if pcfg.micro_batch > 1:
        configured = cfg.rl.micro_batch_size if rl else cfg.train.micro_batch_size
        runs = f", {pcfg.micro_batch} sequences per micro-batch" if pcfg.micro_batch != configured else ""
        if rl and cfg.rl.max_tokens_per_micro_batch:
            options.append(f"lower the micro-batch token budget (rl.max_tokens_per_micro_batch="
                           f"{cfg.rl.max_tokens_per_micro_batch}{runs})")
        else:
            options.append(f"lower the micro-batch ({'rl' if rl else 'train'}.micro_batch_size={configured}{runs})")
    if pcfg.recompute != "full":
        options.append(f"set model.recompute=full (now {pcfg.recompute})")
    options.append(f"raise the tensor/pipeline-parallel size (now TP {pcfg.tp}, PP {pcfg.pp})")
    if pcfg.optimizer == "logra" and pcfg.rank > 1:
        options.append(f"lower optimizer.logra.rank (now {pcfg.rank})")
    if pcfg.engine_fraction > 0 and cfg.rl.rollout.engine == "sglang":
        options.append(f"lower rl.rollout.mem_fraction_static (now {pcfg.engine_fraction:.2f})")
    elif pcfg.engine_fraction > 0:
        options.append(f"serve rollouts from a separate SGLang server (rl.rollout.engine=sglang, "
                       f"rl.rollout.sglang_url): the embedded engine's whole model copy takes "
                       f"{pcfg.engine_fraction:.2f} of this GPU, and its KV cache for {pcfg.rollout_sequences} "
                       f"sequences at once more while it generates")
    return (f"To fit: {'; '.join(options)}. `megatron-logra memory` plans alternatives; train.memory_check=off "
            f"skips this check")


def _device_memory() -> Optional[int]:
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def memory_preflight(cfg: Any, *, tp: int, pp: int, dp: int,
                     gpu_memory_bytes: Optional[int] = None) -> Optional[MemoryPlan]:
    """Plan run ``cfg`` per ``cfg.train.memory_check`` against ``gpu_memory_bytes`` (default: this
    process's CUDA device; without one, and with ``off``, nothing is planned and None returned).

    Raises :class:`MemoryCheckError` when the plan does not fit and ``memory_check=error``.
    """
    mode = cfg.train.memory_check
    gpu = gpu_memory_bytes if gpu_memory_bytes is not None else _device_memory()
    if mode == "off" or gpu is None:
        return None
    pcfg = run_plan_config(cfg, tp=tp, pp=pp, dp=dp, gpu_memory_bytes=gpu)
    if pcfg is None:
        logger.info("memory preflight: the planner does not model optimizer %r; skipped", cfg.optimizer.name)
        return None
    try:
        result = plan(cfg.model, pcfg)
    except Exception as exc:  # noqa: BLE001 - a planner limitation must not stop a run it cannot judge
        logger.warning("memory preflight: the planner cannot plan this run (%s: %s); skipped", type(exc).__name__, exc)
        return None
    w = result.worst
    missing = unmodelled(cfg)
    logger.info("memory preflight: %s; %s (persistent %s, trainer peak %s, engine %s)%s", layout_text(result),
                verdict_line(result), format_bytes(w.persistent), format_bytes(w.trainer_peak), format_bytes(w.engine),
                f"; not modelled: {', '.join(missing)}" if missing else "")
    if not result.fits:
        message = (f"the memory planner says this run does not fit its GPU: {verdict_line(result)}. "
                   f"{fit_hint(cfg, pcfg)}")
        if mode == "error":
            raise MemoryCheckError(message)
        logger.warning(message)
    return result

"""The LM job's start-time checks: the batch layout over the DP ranks and the checks ``megatron-logra config`` runs.

:func:`num_microbatches` splits ``train.global_batch_size`` into micro-batches of ``train.micro_batch_size`` over
the launch's DP ranks, or raises ``ValueError`` naming the fields. :func:`check_config` holds the checks that need
no process group, model or GPU and write nothing; :func:`megatron_logra.train.lm.run_lm` runs the same checks
before anything is written, so what they refuse the job refuses with the same error.
"""

from __future__ import annotations

from megatron_logra.checkpoint.run_dir import check_resume_steps
from megatron_logra.config import RunConfig
from megatron_logra.data.synthetic import SyntheticTask
from megatron_logra.parallel import ParallelGroups

__all__ = ["num_microbatches", "check_config"]


def num_microbatches(cfg: RunConfig, groups: ParallelGroups) -> int:
    """Micro-batches per rank and step; ``ValueError`` naming the fields when ``train.global_batch_size`` does
    not split into micro-batches of ``train.micro_batch_size`` over the DP ranks."""
    per_step = cfg.train.micro_batch_size * groups.dp_size
    if cfg.train.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size × dp = {cfg.train.micro_batch_size} × {groups.dp_size} (dp = world size / "
            f"(parallel.tp × parallel.pp)): set train.global_batch_size to a multiple of {per_step}, or a smaller "
            f"train.micro_batch_size"
        )
    return cfg.train.global_batch_size // per_step


def check_config(cfg: RunConfig) -> None:
    """The start-time checks of the LM job that need no process group, model or GPU and write nothing, as
    ``megatron-logra config`` runs them: the synthetic task (``data.num_symbols`` against ``model.vocab_size``)
    and a resumed run's ``train.steps`` against its latest checkpoint. What they refuse, the job refuses with the
    same error. Not checked here: the micro-batches of the launch's DP ranks, the memory plan, ``train.run_dir``'s
    state and the model build."""
    SyntheticTask(cfg.data, cfg.model.vocab_size)
    if cfg.train.resume:
        check_resume_steps(cfg.train.run_dir, cfg.train.steps, "train.steps")

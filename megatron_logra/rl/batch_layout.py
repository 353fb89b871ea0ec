"""How the RL and warm-start batch sizes split over the parallel layout.

Contract: every data-parallel rank takes the same share of ``rl.prompts_per_step`` and ``sft.batch_size``
(:func:`share_per_rank`), and under pipeline parallelism each rank's sequences per step form one
micro-batch or whole ones (:func:`check_rl_batch_layout`). A layout that cannot split is a ``ValueError``
naming the field and a value that works; a pure function of the config and the sizes, the same on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_logra.config import RunConfig

__all__ = ["check_rl_batch_layout", "share_per_rank"]


def share_per_rank(name: str, total: int, dp_size: int, what: str) -> int:
    """Each data-parallel rank's share of ``total`` items of the field ``name`` (``rl.prompts_per_step``,
    ``sft.batch_size``). Every rank must take the same number: a total that does not divide evenly
    (or a DP size larger than it) is a ``ValueError`` naming the field and a value that works."""
    share, rest = divmod(total, dp_size)
    if rest:
        raise ValueError(
            f"{name}={total} is not divisible by the data-parallel size {dp_size} (world size / (parallel.tp × "
            f"parallel.pp)): every DP rank takes the same number of {what}; set {name} to a multiple of {dp_size} "
            f"(e.g. {-(-total // dp_size) * dp_size}) or launch a layout whose DP size divides {total}")
    return share


def _check_pipeline_microbatches(rows: int, how: str, micro_batch_size: int, pp_size: int, change: str) -> None:
    """Under pipeline parallelism every micro-batch of a step must have one shape (the schedule passes
    the first one's to every stage): ``rows`` must be one micro-batch or whole ones."""
    if pp_size == 1 or rows <= micro_batch_size or rows % micro_batch_size == 0:
        return
    fits = max(d for d in range(1, micro_batch_size + 1) if rows % d == 0)
    raise ValueError(
        f"rl.micro_batch_size={micro_batch_size} does not split the {rows} sequences each data-parallel rank trains "
        f"on per step ({how}) into equal micro-batches, which pipeline parallelism (pipeline-parallel size {pp_size}) "
        f"needs; set rl.micro_batch_size to a divisor of {rows} (e.g. {fits}) or to {rows} or more, or change {change}")


def check_rl_batch_layout(cfg: "RunConfig", dp_size: int, pp_size: int) -> None:
    """Refuse RL / warm-start batch sizes that the parallel layout cannot split evenly (``ValueError``
    naming the field and the fix); a pure function of the config and the sizes, the same on every rank.

    * ``rl.prompts_per_step`` must divide over the ``dp_size`` data-parallel ranks (``share_per_rank``).
    * ``rl.max_tokens_per_micro_batch`` (micro-batches of different shapes) needs ``pp_size == 1``.
    * With ``pp_size > 1`` each rank's ``rl.prompts_per_step / dp × rl.group_size`` sequences must be one
      micro-batch or whole micro-batches of ``rl.micro_batch_size`` (at ``pp_size == 1`` a smaller last
      micro-batch is fine).
    * When the supervised warm start trains (``sft.steps > 0`` without ``model.hf_path`` or
      ``sft.init_path``), the same for its ``sft.batch_size`` demonstrations per step (in micro-batches
      of ``rl.micro_batch_size``).
    """
    if dp_size < 1 or pp_size < 1:
        raise ValueError(f"data-parallel size {dp_size} and pipeline-parallel size {pp_size} must be >= 1")
    rl, sft = cfg.rl, cfg.sft
    prompts = share_per_rank("rl.prompts_per_step", rl.prompts_per_step, dp_size, "prompts")
    if rl.max_tokens_per_micro_batch and pp_size > 1:
        raise ValueError(
            f"rl.max_tokens_per_micro_batch={rl.max_tokens_per_micro_batch} makes micro-batches of different "
            f"shapes, which pipeline parallelism (pipeline-parallel size {pp_size}) cannot pass between stages: "
            f"set rl.max_tokens_per_micro_batch=0 (fixed micro-batches of rl.micro_batch_size) or parallel.pp=1")
    _check_pipeline_microbatches(
        prompts * rl.group_size,
        f"rl.prompts_per_step={rl.prompts_per_step} / data-parallel size {dp_size} × rl.group_size={rl.group_size}",
        rl.micro_batch_size, pp_size, "rl.prompts_per_step or rl.group_size")
    if sft.steps > 0 and not cfg.model.hf_path and not sft.init_path:
        demos = share_per_rank("sft.batch_size", sft.batch_size, dp_size, "demonstrations per warm-start step")
        _check_pipeline_microbatches(demos, f"sft.batch_size={sft.batch_size} / data-parallel size {dp_size}",
                                     rl.micro_batch_size, pp_size, "sft.batch_size")

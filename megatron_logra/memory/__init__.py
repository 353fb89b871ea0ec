"""Memory planner: per-rank training memory (weights, optimizer state, activations, logits, a colocated
rollout engine) of a model at a parallel layout, dense AdamW vs LoGRA, before launching anything.

See ``docs/memory.md``. :mod:`~megatron_logra.memory.count` builds the megatron model on the meta device
for exact parameter counts; :mod:`~megatron_logra.memory.planner` is pure arithmetic on those counts
(activation and logit formulas in :mod:`~megatron_logra.memory.activations`, one layer's saved tensors in
:mod:`~megatron_logra.memory.saved_tensors`) for a
:class:`~megatron_logra.memory.plan_config.PlanConfig` whose layout :mod:`~megatron_logra.memory.layout` checked,
giving :mod:`~megatron_logra.memory.breakdown`'s per-rank ``RankMemory`` lines and the ``MemoryPlan`` verdict;
:mod:`~megatron_logra.memory.units` parses sizes such as ``80GiB``; :mod:`~megatron_logra.memory.report`
renders plans as rich or markdown tables; :mod:`~megatron_logra.memory.cli` is ``megatron-logra memory``.

    from megatron_logra.memory import plan, compare, PlanConfig
    from megatron_logra.models.presets import get_preset

    dense, logra = compare(get_preset("27b"), PlanConfig(tp=8, rank=128, recompute="full", engine_fraction=0.3))
    logra.verdict, logra.worst.total
"""

from megatron_logra.memory.breakdown import MemoryPlan, RankMemory
from megatron_logra.memory.count import ParamCounts, TargetShape, count_params
from megatron_logra.memory.layout import check_layout
from megatron_logra.memory.plan_config import PlanConfig
from megatron_logra.memory.planner import compare, plan
from megatron_logra.memory.units import format_bytes, parse_bytes

__all__ = ["ParamCounts", "TargetShape", "count_params", "MemoryPlan", "PlanConfig", "RankMemory", "check_layout",
           "compare", "plan", "format_bytes", "parse_bytes"]

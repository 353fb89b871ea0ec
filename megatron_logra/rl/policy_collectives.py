"""Collectives of policy sync: every rank agreeing on an outcome (:func:`any_rank`) and the pipeline
stages' parts of a step's delta brought to the ranks whose engine takes them (:func:`stage_parts`).

Both are called by every rank at the same points of :class:`~megatron_logra.rl.policy_sync.PolicySync`
(a refit, a delta, a drift check), whatever that rank's own outcome: a rank that failed still joins
them, so a failure on one rank becomes a decision of all ranks instead of a rank left waiting in a
collective the others skipped.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_logra.optim.native import reduce_flag_any
from megatron_logra.parallel import ParallelGroups, all_gather_bytes, all_reduce_sum, world_group
from megatron_logra.sync import SyncError, encode

logger = logging.getLogger(__name__)

__all__ = ["any_rank", "stage_parts"]


def any_rank(flag: bool) -> bool:
    """``flag`` on any rank of the job. A model-parallel group must refit together (``full``
    gathers over TP and PP): engines that each rank owns (embedded, directory transport) can
    differ, e.g. one rank out of memory, and a driven engine shares one outcome within its group
    only. Agreeing over the data-parallel replicas too keeps every replica's engine at the same
    weights and every rank's record of the sync (``sync_mode``, ``sync_drift``) the same: a drift
    in any replica shows in the metrics rank 0 writes."""
    return reduce_flag_any(flag, world_group(), torch.device("cpu"))


def stage_parts(delta: Any, groups: ParallelGroups, receives: bool) -> Optional[list[bytes]]:
    """Under pipeline parallelism, every stage's encoded part of the step's delta (collective over
    the PP group; exchanged only when some rank of the group receives, and gathered to that rank
    alone when it is the only one); None at PP = 1, on a rank whose group has no receiver, or on a
    non-receiving rank of a group with one receiver (``receives``: this rank's engine takes payloads). A
    part that cannot be encoded travels empty, so the receiving rank's decode rejects it (one ``SyncError``
    for everyone) instead of a rank leaving the collective."""
    if groups.pp_size == 1:
        return None
    wanted = torch.zeros(groups.pp_size, dtype=torch.float64)
    wanted[groups.pp_rank] = float(receives)
    receivers = [i for i, w in enumerate(all_reduce_sum(wanted, groups.pp).tolist()) if w]
    if not receivers:
        return None
    try:
        mine = encode(delta)
    except SyncError as exc:
        logger.warning("sync: this stage's delta part cannot be encoded (%s)", exc)
        mine = b""
    if len(receivers) > 1:  # engines each rank owns: every stage needs every part
        return all_gather_bytes(mine, groups.pp)
    # one driving rank: only it collects the parts (the other stages hold no copy of the step's delta)
    gathered: Optional[list] = [None] * groups.pp_size if receives else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(groups.pp, receivers[0]), group=groups.pp)
    return gathered

"""The launch this CLI process runs in: its rank and world size as the launcher (torchrun) set them, and the
logging each rank gets.

Read from the environment before any process group exists (a process group's own values win where one does:
:func:`launch_world_size`); an environment the trainer would refuse reads as one process of rank 0 here, and
:func:`megatron_logra.parallel.launch_rank_and_world` reports it when the job starts.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megatron_logra.config import RunConfig

__all__ = ["check_same_config_on_every_rank", "is_rank0", "launch_rank", "launch_world_size", "peer_rank",
           "setup_logging"]

_LISTED_DIFFERENCES = 4
"""How many differing fields :func:`check_same_config_on_every_rank` names before it counts the rest."""


def launch_rank() -> int:
    """This process's ``RANK`` as a launcher set it; 0 when unset or not an integer (the job then refuses the
    launch with an error naming the variable: :func:`megatron_logra.parallel.launch_rank_and_world`)."""
    try:
        return int(os.environ.get("RANK", "").strip() or 0)
    except ValueError:
        return 0


def is_rank0() -> bool:
    """Whether this process is rank 0 of its launch (or runs without a launcher): the one that prints results."""
    return launch_rank() == 0


def peer_rank() -> Optional[int]:
    """This process's rank when it is one of ranks 1..N-1 of a multi-process launch (``RANK`` and ``WORLD_SIZE``
    both integers, ``0 < RANK < WORLD_SIZE``); None for rank 0, for one process and for an inconsistent launch
    environment (which every rank reports itself: :func:`megatron_logra.parallel.launch_rank_and_world`)."""
    try:
        rank, world = int(os.environ.get("RANK", "").strip()), int(os.environ.get("WORLD_SIZE", "").strip())
    except ValueError:
        return None
    return rank if 0 < rank < world else None


def launch_world_size() -> int:
    """The number of processes this launch runs (as :func:`megatron_logra.parallel.init_distributed` will see it):
    the process group's when one exists, else torchrun's ``WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def setup_logging() -> None:
    """Root logging for a command: INFO on rank 0, WARNING on the other ranks; megatron-core's import-time
    warnings about optional packages silenced."""
    rank = launch_rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # megatron-core warns at import and build time that TE/apex are absent (expected on CPU)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    # megatron-core's checkpoint loading calls torch.distributed.checkpoint APIs torch has deprecated (ShardedTensor,
    # load_state_dict): three FutureWarnings per load that no setting here can act on
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"(Please use DTensor instead|`load_state_dict` is deprecated)")
    # its Megatron-FSDP package announces itself at import (INFO); this trainer does not use FSDP
    logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)


def check_same_config_on_every_rank(cfg: RunConfig, command: str) -> None:
    """Collective over every rank of a multi-process launch (nothing for one process): joins the process group
    (``cfg.parallel``'s backend and timeout, as the job would) and compares every rank's resolved ``cfg`` with
    rank 0's. A rank given other arguments or files (a per-node line of a launch script, another checkout or
    recipe file on one node) would otherwise build another model or optimizer and fail deep inside a collective,
    or wait there until ``parallel.timeout_minutes``. Raises ValueError, the same one on every rank, naming the
    first rank that differs and up to four fields with both values; credentials are compared redacted, as
    ``config.yaml`` holds them, and paths into this package's own files relative to where each rank has it
    installed."""
    if launch_world_size() <= 1:
        return
    from megatron_logra.config.codec import to_dict
    from megatron_logra.config.recipe_files import _flatten
    from megatron_logra.parallel import all_gather_bytes, init_distributed, world_group
    from megatron_logra.rollout.sglang_setup import redact_config

    init_distributed(cfg.parallel.backend, cfg.parallel.timeout_minutes)
    mine = {key: _package_relative(value) for key, value in _flatten(redact_config(to_dict(cfg)))}
    payloads = all_gather_bytes(json.dumps(mine, sort_keys=True, default=repr).encode(), world_group())
    configs = [json.loads(p) for p in payloads]
    for rank, other in enumerate(configs[1:], start=1):
        keys = sorted(set(configs[0]) | set(other))
        differ = [k for k in keys if _shown(configs[0], k) != _shown(other, k)]  # as text: NaN equals NaN
        if not differ:
            continue
        named = "; ".join(f"{k}={_shown(other, k)} on rank {rank}, {_shown(configs[0], k)} on rank 0"
                          for k in differ[:_LISTED_DIFFERENCES])
        more = f" (and {len(differ) - _LISTED_DIFFERENCES} more)" if len(differ) > _LISTED_DIFFERENCES else ""
        raise ValueError(f"the ranks of this launch resolved different configs for {command}: {named}{more}; "
                         f"start every rank with the same arguments, recipe files and run directory (check the "
                         f"launch script's per-node lines and that every node has the same files)")


def _package_relative(value: object) -> object:
    """A path into this package's own files (the shipped recipes' ``tokenizer.path`` and ``sft.init_path``) as
    ``<megatron_logra>/...``: nodes may install the package at other paths, and those files are the same."""
    from pathlib import Path

    import megatron_logra

    root = str(Path(megatron_logra.__file__).resolve().parent)
    if isinstance(value, str) and (value == root or value.startswith(root + os.sep)):
        return "<megatron_logra>" + value[len(root):]
    return value


def _shown(flat: dict, key: str) -> str:
    """``flat[key]`` as a config value is written (JSON), or ``(unset)``."""
    return json.dumps(flat[key]) if key in flat else "(unset)"

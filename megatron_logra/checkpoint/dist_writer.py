"""megatron-core's ``dist_checkpointing.save`` (torch_dist backend), in phases that fail together.

The phases are megatron-core's own (access-integrity check, ``common.pt``, the sharded tensors, the
checkpoint's ``metadata.json``), each ending in :func:`~megatron_logra.checkpoint.collective._shared_outcome`;
two patches of megatron-core's writer, valid because every save here is synchronous, keep the write
results in-process and keep a failed ``dist/.metadata`` write from stranding the other ranks.
"""

from __future__ import annotations

import contextlib
import queue
from pathlib import Path

from megatron_logra.checkpoint.collective import _on_every_rank
from megatron_logra.checkpoint.integrity import CheckpointError
from megatron_logra.parallel import group_rank, world_group


def _save_dist(step: int, root: Path, sharded: dict, out: Path) -> None:
    """megatron-core's ``dist_checkpointing.save`` (torch_dist backend) in phases, each ending in a
    :func:`_shared_outcome`, so that a failure on any rank (rank 0's ``common.pt`` or ``metadata.json``
    write, which only rank 0 does, outside any collective) is the same :class:`CheckpointError` on
    every rank instead of leaving the others in the next collective. The files written are the same."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_common_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded_strategy = get_default_save_sharded_strategy()
    common_strategy = get_default_save_common_strategy()
    if not sharded_strategy.can_handle_sharded_objects:  # torch_dist stores ShardedObjects itself
        raise CheckpointError(f"the {sharded_strategy.backend} checkpoint backend does not store sharded objects")
    # collective (megatron-core's access-integrity check gathers every rank's shards; rank 0 judges them)
    sharded_part, common = _on_every_rank(step, root, "checking the sharded state", lambda: save_preprocess(sharded))
    _on_every_rank(step, root, "writing the common state (common.pt)",
                   lambda: common_strategy.save_common(common, str(out)))  # rank 0 writes it
    def write_shards() -> None:
        _in_process_write_results()
        with _metadata_write_failures() as failures:
            sharded_strategy.save(sharded_part, str(out))
        if failures:  # rank 0's dist/.metadata: raised here, after the ranks left megatron-core's collectives
            raise failures[0]

    _on_every_rank(step, root, "writing the sharded tensors", write_shards)

    def write_config() -> None:
        if group_rank(world_group()) == 0:
            save_config(CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version), str(out))

    _on_every_rank(step, root, "writing the checkpoint's metadata.json", write_config)


def _in_process_write_results() -> None:
    """Give megatron-core's torch_dist writer an in-process queue for its write results.

    The writer's workers (forked by the saving process) report to that process, which puts the collected
    results on ``filesystem_async._results_queue`` and reads them back itself. megatron-core fills that
    module attribute at the first save with the queue of a ``multiprocessing`` Manager: a spawned helper
    process, kept for the life of the job, which its asynchronous saves need and this project's synchronous
    saves do not. It costs a fresh interpreter that imports torch to unpickle the results (2-3 s at the
    first save of every rank), and it is one more process that a stop signal sent to a whole job step
    (Slurm) reaches: killed, it takes the save the stop asked for down with a broken pipe. A
    ``queue.Queue`` does the same job inside the saving process. Set once; a queue already set (another
    caller's) is left as it is.

    This patches megatron-core (the module attribute
    ``megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue``) on every device, GPUs
    included; it is valid because every save here is synchronous (``dist_checkpointing.save`` without
    ``async_sharded_save``). The CPU-only patches are in ``megatron_logra/cpu_shim.py``, whose docstring
    lists the others."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if hasattr(filesystem_async, "_get_write_results_queue") and getattr(filesystem_async, "_results_queue",
                                                                          True) is None:
        filesystem_async._results_queue = queue.Queue()


@contextlib.contextmanager
def _metadata_write_failures():
    """Collect (instead of raise) the errors of DCP's ``dist/.metadata`` write during one sharded save.

    megatron-core's coordinator (rank 0) writes ``.metadata`` (``FileSystemWriterAsync.finish``) and
    only then broadcasts whether the save failed; an exception from that write (a full disk) skips the
    broadcast, leaving the other ranks in it while rank 0 moves on to the next collective. The writer
    the torch_dist strategy builds is swapped, for this save only, for a subclass whose ``finish``
    records its error, so the broadcast happens and the caller raises the error afterwards.

    This patches megatron-core (the module attribute
    ``megatron.core.dist_checkpointing.strategies.torch.FileSystemWriterAsync``, restored on exit) on every
    device, GPUs included: megatron-core offers no hook for the failure. The CPU-only patches are in
    ``megatron_logra/cpu_shim.py``, whose docstring lists the others."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy

    base = mcore_torch_strategy.FileSystemWriterAsync
    failures: list[BaseException] = []

    class _Writer(base):  # type: ignore[misc,valid-type]
        def finish(self, *args, **kwargs):
            try:
                return super().finish(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised by the caller after the broadcast
                failures.append(exc)

    mcore_torch_strategy.FileSystemWriterAsync = _Writer
    try:
        yield failures
    finally:
        mcore_torch_strategy.FileSystemWriterAsync = base

"""Sharded, atomic, layout-independent checkpoints (megatron-core ``dist_checkpointing``).

See :mod:`megatron_logra.checkpoint.store` for the on-disk format and guarantees.
"""

from megatron_logra.checkpoint.store import (
    FORMAT_VERSION,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)

__all__ = ["FORMAT_VERSION", "CheckpointError", "latest_checkpoint", "load_checkpoint", "read_meta",
           "save_checkpoint"]

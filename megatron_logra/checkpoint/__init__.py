"""Sharded, atomic, layout-independent checkpoints: save and resume everything stateful with megatron-core
``dist_checkpointing``.

A checkpoint ``RUN/checkpoints/step_XXXXXXXX/`` holds

* ``dist/`` — megatron-core's sharded checkpoint (torch_dist backend) of the model and every
  optimizer tensor (AdamW moments, fp32 masters, LoGRA row moments), each a slice of a global
  tensor, so it loads under any tensor / pipeline / data-parallel layout. Projections are
  regenerated from ``(seed, layer, update)``, never stored.
* ``rng_rank{r}.safetensors`` — each rank's RNG states (restored when the layout is the same).
* ``meta.json`` — written last: format version, step, layout, the layout-independent scalars
  (optimizer counters, KL-controller and RL-loop state), the config, and every other file under
  ``files`` as ``{relative path: {"bytes": size, "crc32": "8 hex digits"}}`` (``crc32`` absent
  when saved with ``checksums=False``; checkpoints of older versions hold plain sizes, which
  still load, with sizes checked only).

A save goes to ``step_XXXXXXXX.tmp`` and is renamed when complete (a checkpoint of the same step already there
is renamed aside to ``step_XXXXXXXX.old-PID`` first and deleted only after ``latest`` is written:
:mod:`.catalog`); ``RUN/checkpoints/latest``
names the newest complete checkpoint and is replaced atomically after the rename, so a kill at
any moment (including mid-save) leaves the previous checkpoint usable. Every file is fsync'ed by
the rank that wrote it, and meta.json, ``latest`` and the directories by rank 0, before the save
is published, so a node crash or power loss cannot leave ``latest`` naming a checkpoint whose
files never reached storage (``latest`` missing altogether, e.g. a kill between the first rename and
its write: the newest complete checkpoint, with a warning; a ``latest`` naming anything else than a
complete ``step_XXXXXXXX`` beside it is refused, naming the newest earlier one to continue from:
:func:`latest_checkpoint`). meta.json carries a CRC-32 of its own content (``meta_crc32``). A
failure on any rank during a save reaches every rank as the same :class:`CheckpointError`.
Pruning keeps the ``keep_last`` newest checkpoints up to the step just saved; checkpoints of
later steps (left by a run whose ``latest`` was rolled back) are kept, and unfinished
``step_*.tmp`` saves of any step are removed. Loading checks, before
anything is modified: the format, every recorded file's presence and size (cheap), then every
recorded CRC-32 (reads each file once: a shard corrupted at the same size is named instead of
loading as wrong weights), then that ``dist/``'s pickles (DCP's ``.metadata`` index, the stored byte
objects) hold plain data only (:mod:`.dcp_metadata`: a crafted checkpoint is refused instead of
running code, whatever its CRC-32s), then the presence of every tensor.

The CRC-32s (``zlib.crc32``, 16 MiB chunks, so memory stays flat; :mod:`.integrity`) are computed
by all ranks together, at save and at load: the files are split into disjoint shares balanced by
size (``checksum_shares``), each rank hashes its share on a few threads (zlib releases the GIL)
and the results are gathered over the world group, so every rank raises the same error. CRC-32
detects accidental corruption (bit flips, torn or overwritten blocks), not tampering; it runs at
~3.4 GB/s per core where sha256 manages ~1.5 GB/s, i.e. ~0.3 s per GB per rank at save and load.

megatron-core's torch_dist writer collects results through a ``multiprocessing`` manager started
with ``spawn``: a script that calls the training functions directly must guard its entry point
with ``if __name__ == "__main__":`` (the ``megatron-logra`` CLI does).

Modules: :mod:`.save` (writing), :mod:`.load` (restoring), :mod:`.catalog` (``latest``, pruning, what to
resume from), :mod:`.collective` (one outcome on every rank), :mod:`.dist_writer` (megatron-core's save in
phases), :mod:`.durable` (fsync), :mod:`.integrity` (CRC-32s, meta.json), :mod:`.compat` (architecture and
optimizer settings against the run's), :mod:`.sharding` (sharded state dicts), :mod:`.rng`.
"""

from megatron_logra.checkpoint.catalog import latest_checkpoint
from megatron_logra.checkpoint.integrity import FORMAT_VERSION, CheckpointError, read_meta
from megatron_logra.checkpoint.load import load_checkpoint
from megatron_logra.checkpoint.save import save_checkpoint

__all__ = ["FORMAT_VERSION", "CheckpointError", "latest_checkpoint", "load_checkpoint", "read_meta",
           "save_checkpoint"]

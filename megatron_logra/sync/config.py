"""Configuration of policy sync between the trainer and the rollout engine (stdlib only)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SyncConfig", "SYNC_MODES", "TRANSPORTS", "FULL_WEIGHTS"]

SYNC_MODES = ("delta", "full")
TRANSPORTS = ("inprocess", "directory")
FULL_WEIGHTS = ("first_rank", "all", "none")


@dataclass
class SyncConfig:
    """How the rollout engine receives each new policy."""

    mode: str = "delta"
    """``delta``: ship ``U = quantize_factor(α·D)`` per target plus the projection seed and let the
    engine regenerate ``A`` (LoGRA only; other optimizers fall back to ``full``). ``full``: a
    dense refit of every weight after each update."""
    anchor_interval: int = 0
    """Full refit at every weight version that is a multiple of this, even when deltas apply cleanly
    (0 = only on drift). Keyed by the weight version, so a resumed run anchors at the same updates."""
    check_interval: int = 1
    """Compare trainer and engine fingerprints at every weight version that is a multiple of this
    (0 = never); a mismatch triggers a full refit and is counted in the metrics (``sync_drift``)."""
    max_master_drift: float = 5e-3
    """With fp32 masters: re-anchor (copy the masters into the compute weights, full refit) once
    ``‖W − round(master)‖/‖W‖`` over the targets exceeds this (a finite number >= 0; 0 = only at
    ``anchor_interval``). The compute weights take the engine's merges (stochastically rounded in bf16 by
    default, so they follow the masters on average) and drift from them by rounding noise; the re-anchor
    applies the difference at once, outside the KL controller. Measured on a bf16 GPT with the paper recipe:
    at 5e-3 a re-anchor every ~56 updates, each under a tenth of one step's KL budget (1e-2: every ~240,
    1.4 budgets; 3e-3: every ~21). With round-to-nearest merges (``logra.rounding=nearest``) most of each
    step is lost from the compute weights and the drift is lag: at 1e-2 that jump was 86 budgets."""
    transport: str = "inprocess"
    """``inprocess`` (the embedded engine) or ``directory`` (delta files written atomically to
    ``directory``, applied by the consumer in version order; the embedded engine consumes them). Every
    full refit (the run's start, ``anchor_interval``, master re-anchors, drift repairs) also writes the
    refit's full weights, ``full_<version>.safetensors`` in HF names and ``model.params_dtype`` (the
    newest only; which ranks write it and what it costs: ``full_weights``), and an anchor marker there: an
    engine that reads the files itself refuses (``SyncError("anchor")``) to apply deltas past a refit or trainer resume
    whose weights it has not verified, and gets back on the chain by loading that file
    (``DirectoryTransport.load_full``; :mod:`megatron_logra.sync.transport`). A resumed run keeps the
    files up to its weight version."""
    directory: str = ""
    """Root of the delta files for ``transport=directory`` (default: ``RUN_DIR/deltas``). The files are not
    written in it but in one subdirectory per trainer rank, ``<directory>/rank<global rank>/``: each rank whose
    engine receives weights writes its own chain (anchors and deltas) there, so an engine reading the files
    follows the directory of the rank it serves (``<directory>/rank0/`` in a one-process run)."""
    keep_deltas: int = 8
    """With ``transport=directory``: after each update, delta files older than the newest
    ``keep_deltas`` are deleted (a consumer further behind must reload full weights: its ``gap`` error
    names the newest full-weights file). 0 keeps every delta file (no pruning; the directory grows by
    one delta per update)."""
    full_weights: str = "first_rank"
    """With ``transport=directory``: which trainer ranks write each full refit's full weights. Every rank
    holds the same weights at a refit (the model-parallel group gathers the whole model, the data-parallel
    replicas are identical), so every rank's file would hold the same bytes.

    * ``first_rank`` (default): only global rank 0 writes ``<directory>/rank0/full_<version>.safetensors``;
      the other ranks' anchor markers name that file by a path relative to their own directory
      (``../rank0/full_<version>.safetensors``), once rank 0 has written it and their fingerprint of the
      weights equals rank 0's (otherwise their marker names no file). ``<directory>`` must then be one
      filesystem that every engine reading a rank's directory sees.
    * ``all``: every rank writes its own copy into its own directory, for rank directories on separate
      (e.g. node-local) disks; TP·PP·DP times the bytes and the write time of ``first_rank``.
    * ``none``: no full-weights files; the anchor markers name none, and an engine refused at an anchor
      reloads the trainer's weights by other means and calls ``DirectoryTransport.accept_anchor``.

    Cost of a file: the model's parameters in ``model.params_dtype`` (about 2 bytes per parameter in bf16:
    ~54 GB at 27B, ~140 GB at 70B), written synchronously inside every full refit (start of the run,
    ``anchor_interval``, master re-anchors, drift repairs) by each writing rank: a host copy, sha256 and write
    of every tensor, so the refit takes at least model bytes / write bandwidth longer on that rank (the
    others wait for it in the next collective). Disk: the newest file only, but while a refit's file is
    written the previous one is still there, so up to twice the model's bytes per writing rank."""

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ValueError(f"sync.mode={self.mode!r} is unknown; choose one of {SYNC_MODES}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"sync.transport={self.transport!r} is unknown; choose one of {TRANSPORTS}")
        if self.anchor_interval < 0 or self.check_interval < 0:
            raise ValueError("sync.anchor_interval and sync.check_interval must be >= 0 (0 disables)")
        # NaN and inf pass a "< 0" test, and no drift ever exceeds them: the re-anchor would be off unannounced
        if not math.isfinite(self.max_master_drift) or self.max_master_drift < 0:
            raise ValueError(f"sync.max_master_drift={self.max_master_drift} must be a finite number >= 0 (0 disables "
                             f"the drift re-anchor; default 5e-3)")
        if self.full_weights not in FULL_WEIGHTS:
            raise ValueError(f"sync.full_weights={self.full_weights!r} is unknown; choose one of {FULL_WEIGHTS} "
                             f"(first_rank: one file written by rank 0; none: no full-weights files)")
        if self.keep_deltas < 0:
            raise ValueError(f"sync.keep_deltas={self.keep_deltas} must be >= 0 (0 keeps every delta file)")

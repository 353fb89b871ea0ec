"""Sketch-delta policy sync (DESIGN §1 "Sketch-delta policy sync").

Engine side (this package minus ``trainer``): imports only torch, safetensors, the standard
library and ``megatron_logra.sketch.{random_projection, entry_hash, naming}`` -- never megatron-core or
transformers -- so rollout engines can import it. ``megatron_logra.sync.trainer`` (builds deltas
from a ``LograOptimizer``) is trainer-only and is not imported here.
"""

from megatron_logra.sync.apply import apply_delta_, low_rank_merge_, validate
from megatron_logra.sync.codec import FORMAT_VERSION, AttentionDims, SketchDelta, TargetFactor, decode, encode
from megatron_logra.sync.engine import ModuleEngine
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.factors import quantize_factor
from megatron_logra.sync.fingerprint import combined, drift, fingerprint
from megatron_logra.sync.layout import plan_for
from megatron_logra.sync.transport import DirectoryTransport, InProcessTransport

__all__ = [
    "FORMAT_VERSION", "AttentionDims", "SketchDelta", "TargetFactor", "encode", "decode", "SyncError",
    "quantize_factor", "low_rank_merge_", "validate", "apply_delta_", "plan_for", "fingerprint", "combined", "drift",
    "ModuleEngine", "InProcessTransport", "DirectoryTransport",
]

"""IEEE fp32 matmuls for the exact merge, whatever matmul precision the process has chosen.

The merge's GEMM ``V·sign(A)`` is exact only if its fp32 inputs enter the GEMM unrounded: ``V``
carries up to ``24 − ceil(log2 r)`` significant bits (:mod:`megatron_logra.sync.factors`). A
process that allows reduced-precision fp32 matmuls rounds ``V`` inside the GEMM: to TF32 (10
mantissa bits) on Ampere and later GPUs after ``torch.set_float32_matmul_precision("high")`` or
``torch.backends.cuda.matmul.allow_tf32 = True``, to bf16 (7 bits) on CPUs with AMX or AVX512-BF16
after ``"medium"``. Many training scripts and inference servers set one of these. The product is
then neither exact nor the same on the trainer (any TP split) and the engine, the drift check fails
and every sync falls back to a full refit.

:func:`ieee_fp32_matmul` switches the fp32 matmul precision of the CUDA and oneDNN backends to IEEE
for the duration of a merge and puts back exactly what was there. It reads and writes only the
per-backend setting (``torch.backends.<backend>.matmul.fp32_precision``), so a process that uses
the legacy switches (``allow_tf32``, ``set_float32_matmul_precision``) reads the same values
afterwards as before, without torch's error about mixing the two APIs. The switch is process-wide:
a matmul another thread runs meanwhile is computed in IEEE fp32 too (slower, never wrong). Imports
only torch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["ieee_fp32_matmul", "IEEE"]

IEEE = "ieee"
_BACKENDS = ("cuda", "mkldnn")


def _settings() -> list[tuple[object, str, object]]:
    """``(object, attribute, IEEE value)`` of every fp32 matmul precision switch of this torch: the
    per-backend ``fp32_precision``, or on a torch without it the legacy CUDA ``allow_tf32``."""
    out: list[tuple[object, str, object]] = []
    for name in _BACKENDS:
        matmul = getattr(getattr(torch.backends, name, None), "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            out.append((matmul, "fp32_precision", IEEE))
    if not out:
        out.append((torch.backends.cuda.matmul, "allow_tf32", False))
    return out


@contextlib.contextmanager
def ieee_fp32_matmul() -> Iterator[None]:
    """Run the body with IEEE fp32 matmuls on every backend; restore the previous settings on exit
    (also when the body raises). Nests; costs a few attribute reads when nothing needs changing."""
    changed: list[tuple[object, str, object]] = []
    try:
        for obj, attr, ieee in _settings():
            before = getattr(obj, attr)
            if before != ieee:
                setattr(obj, attr, ieee)
                changed.append((obj, attr, before))
        yield
    finally:
        for obj, attr, before in reversed(changed):
            setattr(obj, attr, before)

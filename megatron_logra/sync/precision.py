"""IEEE fp32 arithmetic for the exact merge, whatever matmul precision or denormal mode the process chose.

The merge's GEMM ``V·sign(A)`` is exact only if its fp32 inputs enter the GEMM unrounded: ``V``
carries up to ``24 − ceil(log2 r)`` significant bits (:mod:`megatron_logra.sync.factors`). A
process that allows reduced-precision fp32 matmuls rounds ``V`` inside the GEMM: to TF32 (10
mantissa bits) on Ampere and later GPUs after ``torch.set_float32_matmul_precision("high")`` or
``torch.backends.cuda.matmul.allow_tf32 = True``, to bf16 (7 bits) on CPUs with AMX or AVX512-BF16
after ``"medium"``. Many training scripts and inference servers set one of these. The product is
then neither exact nor the same on the trainer (any TP split) and the engine, the drift check fails
and every sync falls back to a full refit. Likewise ``torch.set_flush_denormal(True)`` makes a CPU
read subnormal weights as zero and flush subnormal results, so a weight below ``2^-126`` merges to
other bits than IEEE arithmetic gives (and than a GPU gives, which this switch does not touch).

:func:`ieee_fp32` switches the fp32 matmul precision of the CUDA and oneDNN backends to IEEE and
turns the CPU's denormal flushing off for the duration of a merge, and puts back exactly what was
there. It reads and writes only the per-backend matmul setting
(``torch.backends.<backend>.matmul.fp32_precision``), so a process that uses the legacy switches
(``allow_tf32``, ``set_float32_matmul_precision``) reads the same values afterwards as before,
without torch's error about mixing the two APIs. torch has no getter for the denormal mode: it is
read off one multiplication of a subnormal. The switches are process-wide: arithmetic another
thread runs meanwhile is IEEE too (at most slower, never wrong). Imports only torch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["ieee_fp32", "flushes_denormals", "IEEE"]

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


_SUBNORMAL = 2.0**-140


def flushes_denormals() -> bool:
    """Whether this process's CPU arithmetic flushes subnormals (``torch.set_flush_denormal(True)``)."""
    x = torch.tensor(_SUBNORMAL, dtype=torch.float32)
    return bool(x * 1.0 == 0)


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """Run the body with IEEE fp32 matmuls on every backend and without denormal flushing; restore the
    previous settings on exit (also when the body raises). Nests; costs a few attribute reads and one
    scalar multiplication when nothing needs changing."""
    changed: list[tuple[object, str, object]] = []
    flushing = False
    try:
        for obj, attr, ieee in _settings():
            before = getattr(obj, attr)
            if before != ieee:
                setattr(obj, attr, ieee)
                changed.append((obj, attr, before))
        flushing = flushes_denormals()
        if flushing:
            torch.set_flush_denormal(False)
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(True)
        for obj, attr, before in reversed(changed):
            setattr(obj, attr, before)

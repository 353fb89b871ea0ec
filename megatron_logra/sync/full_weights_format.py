"""The on-disk format of full-weights files, shared by their writer and their reader.

Owns what both sides must agree on byte for byte: the file name of a version (:func:`full_filename`:
``full_{version:08d}.safetensors``, so names sort in version order), the format tag ``logra-full-weights/1``,
the two metadata keys (``logra.full``: the canonical JSON ``{"format", "version", "dtype", "tensors"}``, sorted
keys and no spaces, plus ``"vocab_rows"`` when the file holds a vocabulary-parallel tensor; ``logra.full.sha256``:
the digest), the prefix ``b"logra-full-weights|"`` the digest starts from, the 64 zeros the writer puts in the
digest's slot of the header and overwrites in place once every tensor is written, and the safetensors dtype
codes of the three dtypes a file may hold (F32, BF16, F16). The tensors' data follow the header contiguously,
in the order they were declared. The file itself is described in :mod:`megatron_logra.sync.full_weights` (the
writer; :mod:`megatron_logra.sync.full_weights_reader` reads it); these names stay importable from there.

Imports only torch and the standard library.
"""

from __future__ import annotations

from typing import Sequence

import torch


_FULL_FORMAT = "logra-full-weights/1"
_FULL_MAGIC = b"logra-full-weights|"
_FULL_META = "logra.full"
_FULL_META_SHA = "logra.full.sha256"
_PLACEHOLDER = "0" * 64
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def full_filename(version: int) -> str:
    """The full-weights file of ``version`` (8-digit, zero-padded: names sort in version order)."""
    return f"full_{version:08d}.safetensors"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n

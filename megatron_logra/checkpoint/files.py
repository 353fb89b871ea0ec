"""safetensors files that the run's readers can open: :func:`save_safetensors`.

safetensors (0.6 and newer) writes through a private temporary file and renames it, which leaves the file
mode ``0600`` whatever the umask. A checkpoint or warm start on shared storage is then unreadable to anyone
but its writer: another user's ``eval`` / ``convert``, or an inference server running as a service account.
Every other file a run writes takes the umask, so these do too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from safetensors.torch import save_file

__all__ = ["save_safetensors"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Union[str, Path],
                     metadata: Optional[dict[str, str]] = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)`` with the file mode an ``open()`` would give
    (``0666`` less the process's umask)."""
    save_file(dict(tensors), str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())

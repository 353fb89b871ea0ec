"""Each rank's random generators in a checkpoint: torch's host generator, CUDA's, and megatron-core's
tensor-parallel RNG tracker (dropout inside TP regions)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["rng_state", "restore_rng"]


def _tracker_states() -> dict[str, torch.Tensor]:
    """megatron-core's tensor-parallel RNG tracker states (dropout inside TP regions)."""
    try:
        from megatron.core import tensor_parallel

        return {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    except (ImportError, AttributeError):
        return {}


def rng_state() -> dict[str, torch.Tensor]:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    for name, state in _tracker_states().items():
        rng[f"tracker.{name}"] = state
    return rng


def restore_rng(rng: dict[str, torch.Tensor], where: str = "") -> None:
    """Restore the saved generators. A checkpoint saved with CUDA (it holds a ``cuda`` state) and
    resumed without it, or the reverse, restores only the host generator: megatron's tracker
    states are CUDA generator states on a GPU and host ones on a CPU, and do not load into each other."""
    torch.set_rng_state(rng["torch"])
    if ("cuda" in rng) != torch.cuda.is_available():
        logger.warning("%s was saved %s CUDA and is resumed %s it: the host RNG is restored, the device and "
                       "tensor-parallel RNG states start fresh", where or "the checkpoint",
                       "with" if "cuda" in rng else "without", "without" if "cuda" in rng else "with")
        return
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in rng.items() if k.startswith("tracker.")}
    if tracker:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)

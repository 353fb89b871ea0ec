"""A prepared commit replayed at fixed addresses: on a GPU, one CUDA graph launch per sync.

After :mod:`megatron_logra.sync.prepared` an apply still launches a few kernels per engine weight (the
GEMM, the subtraction or the fp32 scratch passes, the rounding noise), each with host-side dispatch:
on a GPU that launch overhead, not the arithmetic, is what an apply costs (a 187M model's merge
kernels take well under a millisecond of device time). :class:`StaticCommit` gives every input of
the commit a fixed address -- ``V`` per device group, the noise hashes, the decay as a 0-d fp32
tensor, the weights, ``sign(A)`` and the workspaces (the last three are fixed already) -- so that
the whole commit can be captured once in a ``torch.cuda.CUDAGraph`` and replayed: per sync the
engine refills the inputs (a few copies) and launches the graph. The arithmetic is the same ops in
the same order on the same addresses, so the weights are the same bits as an eager apply (the decay
product is the same fp32 product whether the factor is a Python float or a 0-d fp32 tensor).

Staging (refilling the inputs and, the first time per decay kind, the capture) happens before the
first write: capturing records kernels without running them, and a capture that fails leaves the
commit to run eagerly on the same fixed-address inputs. On CPU weights (and weights on several GPUs)
the fixed-address commit runs eagerly: what the CPU tests check. One capture per kind of decay
(``decay == 1`` skips the product), kept until the prepared commit is replaced. Imports only torch.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.merge import _Noise
from megatron_logra.sync.prepared_commit import PreparedCommit

logger = logging.getLogger(__name__)

__all__ = ["StaticCommit"]


class StaticCommit:
    """A :class:`PreparedCommit`'s inputs at fixed addresses, and its CUDA graphs."""

    def __init__(self, prepared: PreparedCommit, weights: list[torch.Tensor]) -> None:
        self.prepared = prepared
        self.V: list[torch.Tensor] = []
        self.noise: list[Optional[torch.Tensor]] = []
        self._v: list[Optional[torch.Tensor]] = [None] * len(prepared.merges)
        self._noise: list[Optional[_Noise]] = [None] * len(prepared.merges)
        rank = prepared.merges[0].matrix.shape[-2] if prepared.merges else 0
        for g in prepared.groups:
            V = torch.empty(sum(g.sizes), rank, dtype=torch.float32, device=g.device)
            self.V.append(V)
            for m, v in zip(g.merges, V.split(g.sizes)):
                self._v[m] = v
            if not g.noise_merges:
                self.noise.append(None)
                continue
            row_sizes = [r.numel() for r in g.noise_rows]
            col_sizes = [c.numel() for c in g.noise_cols]
            flat = torch.empty(sum(row_sizes) + sum(col_sizes), dtype=torch.int32, device=g.device)
            self.noise.append(flat)
            parts = flat.split(row_sizes + col_sizes)
            for m, rb, cb in zip(g.noise_merges, parts[: len(row_sizes)], parts[len(row_sizes):]):
                self._noise[m] = (rb, cb)
        self.decay = {w.device: torch.ones((), dtype=torch.float32, device=w.device) for w in weights}
        devices = {w.device for w in weights}
        self.graphable = len(devices) == 1 and next(iter(devices)).type == "cuda"
        self.graphs: dict[bool, Optional["torch.cuda.CUDAGraph"]] = {}

    def stage(self, delta: SketchDelta, weights: list[torch.Tensor]) -> None:
        """Refill every input for ``delta`` (and capture the graph of its decay kind the first time). Writes
        no weight; raises what :meth:`PreparedCommit.group_factors` raises for a bad factor."""
        for static, V in zip(self.V, self.prepared.group_factors(delta)):
            static.copy_(V)
        for static, parts in zip(self.noise, self.prepared.group_noises(delta)):
            if static is not None and parts is not None:
                torch.cat([*parts[0], *parts[1]], out=static)
        plain = delta.decay == 1.0
        if not plain:
            for t in self.decay.values():
                t.fill_(delta.decay)
        if self.graphable and plain not in self.graphs:
            self.graphs[plain] = self._capture(weights, plain)

    def commit_(self, weights: list[torch.Tensor], plain: bool) -> None:
        """The merges of the staged delta (``plain``: its decay is 1): the graph's replay where one was
        captured, else the same kernels eagerly."""
        graph = self.graphs.get(plain)
        if graph is not None:
            graph.replay()
        else:
            self._run(weights, plain)

    def _run(self, weights: list[torch.Tensor], plain: bool) -> None:
        for m, (w, v, noise) in enumerate(zip(weights, self._v, self._noise)):
            self.prepared.merge_(m, w, v, noise, 1.0 if plain else self.decay[w.device])

    def _capture(self, weights: list[torch.Tensor], plain: bool) -> Optional["torch.cuda.CUDAGraph"]:
        device = weights[0].device
        try:
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # cuBLAS's handle and workspace for this stream, outside the capture
                a = torch.ones(16, 16, device=device)
                torch.mm(a, a)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self._run(weights, plain)
            logger.info("sketch-delta commit captured in a CUDA graph (%d weights, decay %s)",
                        len(weights), "1" if plain else "!= 1")
            return graph
        except Exception as exc:  # a kernel that cannot be captured: run the same kernels eagerly
            logger.warning("capturing the sketch-delta commit in a CUDA graph failed (%r); it runs eagerly", exc)
            return None

"""GaLore and APOLLO as peers of LoGRA, through the project's dense-gradient path.

Both peers need the dense gradient of every matrix they optimise, so they run on the
``DenseAdamW`` machinery (fp32 main grads, fp32 masters for 16-bit weights, data-parallel
reduction, token normalisation and global-norm clipping in ``prepare``) with its inner
``torch.optim.AdamW`` swapped for the peer's optimizer: the *target* 2-D weights that LoGRA
sketches (``linear_qkv / linear_proj / linear_fc1 / linear_fc2``, or whatever the LoGRA
config targets) form the peer's low-rank param group, every other trainable parameter is a
plain-Adam group of the same optimizer object. Model, data and seeds are the caller's, so a
peer differs from dense AdamW and LoGRA in the optimizer only.

The peers are optional (``pip install megatron_logra[bench]``); :func:`peer_missing` says why
one cannot run so the benchmark can skip it and report that instead of crashing.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from megatron_logra.optim.config import NativeConfig, OptimizerConfig
from megatron_logra.optim.dense import DenseAdamW
from megatron_logra.parallel import ParallelGroups
from megatron_logra.sketch.naming import TARGET_ALIASES

logger = logging.getLogger(__name__)

__all__ = ["PEERS", "PeerSettings", "PeerOptimizer", "peer_missing", "target_weights", "peer_factory"]

PEERS = {"galore": ("galore_torch", "GaLoreAdamW", "galore-torch"),
         "apollo": ("apollo_torch", "APOLLOAdamW", "apollo-torch")}
"""peer name -> (import name, optimizer class, pip distribution)."""


@dataclass(frozen=True)
class PeerSettings:
    """The low-rank group's settings of a peer (names as in the peers' own param groups)."""

    rank: int
    """Projection rank r (the same r LoGRA uses, for a like-for-like comparison)."""
    update_proj_gap: int = 200
    """Updates between projector refreshes (GaLore: SVD of the current gradient; APOLLO: a new random draw)."""
    scale: float = 1.0
    """GaLore's α on the projected-back update; APOLLO's scale on the channel-scaled gradient."""


def peer_missing(name: str) -> Optional[str]:
    """None when peer ``name`` can run here, else a one-line reason (shown in the report)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose one of {sorted(PEERS)}")
    module, cls, dist = PEERS[name]
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken optional dependency (bitsandbytes)
        return f"`{module}` cannot be imported ({type(exc).__name__}: {exc}); `pip install {dist}` or the `bench` extra"
    if not hasattr(mod, cls):
        return f"`{module}` has no `{cls}` (version {getattr(mod, '__version__', '?')})"
    return None


def _is_target(leaf: str, targets: Sequence[str]) -> bool:
    kinds = {TARGET_ALIASES.get(t, t) for t in targets}
    return leaf in targets or TARGET_ALIASES.get(leaf) in kinds


def target_weights(model: Union[nn.Module, Sequence[nn.Module]], targets: Sequence[str]) -> list[nn.Parameter]:
    """The 2-D weights of the modules LoGRA would target (same leaf-name rule as ``install_sketches``)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    found = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            weight = getattr(module, "weight", None)
            if _is_target(name.split(".")[-1], targets) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                found.append(weight)
    if not found:
        raise ValueError(f"no module of the model matches the targets {list(targets)}")
    return found


class PeerOptimizer(DenseAdamW):
    """``DenseAdamW`` whose inner optimizer is GaLore's or APOLLO's AdamW.

    ``prepare`` / ``apply`` / ``zero_grad`` are DenseAdamW's (dense gradients, clipping,
    token normalisation); only the Adam step of the target matrices is the peer's low-rank
    one. ``state_dict`` keeps tensors and numbers only (projector objects are dropped):
    enough for the run's final checkpoint, not for resuming a peer run.
    """

    def __init__(self, model: Union[nn.Module, Sequence[nn.Module]], cfg: NativeConfig, groups: ParallelGroups, *,
                 peer: str, settings: PeerSettings, targets: Sequence[str], clip_grad: float = 1.0) -> None:
        reason = peer_missing(peer)
        if reason is not None:
            raise RuntimeError(f"peer {peer} is unavailable: {reason}")
        super().__init__(model, cfg, groups, clip_grad=clip_grad)
        self.peer = peer
        self.settings = settings
        wanted = {id(w) for w in target_weights(model, targets)}
        native = self.native
        low_rank = [m for p, m in zip(native.params, native.masters) if id(p) in wanted]
        rest = [m for p, m in zip(native.params, native.masters) if id(p) not in wanted]
        if not low_rank:
            raise ValueError(f"none of the targets {list(targets)} is trainable; nothing for {peer} to project")
        self.num_low_rank = sum(m.numel() for m in low_rank)
        self._low_rank_ids = {id(m) for m in low_rank}
        group = {"params": low_rank, "rank": settings.rank, "update_proj_gap": settings.update_proj_gap,
                 "scale": settings.scale, "proj_type": "std"}
        module, cls_name, _ = PEERS[peer]
        cls = getattr(importlib.import_module(module), cls_name)
        kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                      weight_decay=cfg.weight_decay, no_deprecation_warning=True)
        if peer == "apollo":
            group.update(proj="random", scale_type="channel")
        param_groups = ([{"params": rest}] if rest else []) + [group]
        native.inner = cls(param_groups, **kwargs)
        if peer == "apollo":  # APOLLO seeds its projector per parameter, but only for params requiring grad
            for index, m in enumerate(low_rank):
                native.inner.state[m].setdefault("seed", 1000 + index)
        logger.info("%s on %d target matrices (%d params, rank %d), AdamW on %d other tensors", peer,
                    len(low_rank), self.num_low_rank, settings.rank, len(rest))

    def persistent_bytes(self) -> dict[str, int]:
        """Bytes of the optimizer's tensors that live across steps (from the real state)."""
        out = super().persistent_bytes()
        moments = projector = 0
        for state in self.native.inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key.startswith("exp_avg"):
                    moments += value.numel() * value.element_size()
            proj = state.get("projector")
            for attr in ("ortho_matrix",):
                t = getattr(proj, attr, None) if proj is not None else None
                if isinstance(t, torch.Tensor):
                    projector += t.numel() * t.element_size()
        out.update(moments=moments, projector=projector)
        return out

    def state_dict(self) -> dict:
        inner = self.native.inner.state_dict()
        inner["state"] = {k: {n: v for n, v in s.items() if isinstance(v, (torch.Tensor, int, float))}
                          for k, s in inner["state"].items()}
        return {"kind": self.peer, "num_steps": self.num_steps, "num_skipped": self.num_skipped,
                "native": {"inner": inner}}

    def sharded_state(self):
        """Checkpoint slots of the parameter-shaped state only (plain-Adam moments, masters): the
        peer's low-rank moments are not parameter-shaped and are left out, like its projectors."""
        from megatron_logra.optim.state import ParamSlot

        native, slots = self.native, []
        for p, m in zip(native.params, native.masters):
            state = native.inner.state.get(m, {})
            if id(m) not in self._low_rank_ids:
                for name in ("exp_avg", "exp_avg_sq"):
                    buf = state.get(name)
                    slots.append(ParamSlot(f"native.{name}", p, buf if buf is not None else torch.zeros_like(m)))
            if m is not p:
                slots.append(ParamSlot("native.master", p, m))
        return {"kind": self.peer, "num_steps": self.num_steps, "num_skipped": self.num_skipped}, slots

    def load_sharded_state(self, scalars: dict, slots: list) -> None:
        raise NotImplementedError(f"resuming a {self.peer} benchmark run is not supported (projectors are not saved)")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError(f"resuming a {self.peer} benchmark run is not supported (projectors are not saved)")


def peer_factory(peer: str, settings: PeerSettings) -> Callable[[Any, OptimizerConfig, ParallelGroups], PeerOptimizer]:
    """An ``optimizer_factory`` for ``rl.job.run_rl``: the peer on the LoGRA targets of
    ``cfg.logra.targets``, AdamW (``cfg.native``) on everything else, clipping at ``cfg.logra.clip_grad``."""

    def build(model: Any, cfg: OptimizerConfig, groups: ParallelGroups) -> PeerOptimizer:
        return PeerOptimizer(model, cfg.native, groups, peer=peer, settings=settings, targets=cfg.logra.targets,
                             clip_grad=cfg.logra.clip_grad)

    return build

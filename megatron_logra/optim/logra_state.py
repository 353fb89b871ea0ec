"""Checkpoint contract of :class:`megatron_logra.optim.logra.LograOptimizer`.

What a LoGRA optimizer saves: row moments (row-shaped slots), fp32 masters of low-precision
targets (parameter-shaped slots), the native AdamW's state and the step counters. Projections
are a pure function of ``(seed, name, update index)`` and are regenerated, never stored; a
checkpoint taken with another rank, seed or distribution is refused because its row moments
belong to that projection, and one taken with another algorithm or refresh setting because its
row moments were updated under it (recorded in checkpoints since; older ones are accepted).
The sharded scalars also record which parameters the state has slots for: the target kinds
(``targets``) and whether the non-targets are frozen (``native_freeze``); a resume that changes
either is refused by name before any tensor is read (checkpoints that do not record them are
accepted).
"""

from __future__ import annotations

from megatron_logra.optim.loss_scale import restore_scaler, scaler_fields
from megatron_logra.optim.state import ParamSlot, SlotState
from megatron_logra.sketch.naming import TARGET_ALIASES

__all__ = ["LograStateMixin"]


class LograStateMixin:
    """``state_dict`` / ``sharded_state`` and their loaders; needs ``cfg``, ``targets``, ``sketches``,
    ``native``, ``row_moments``, ``masters``, ``num_steps``, ``num_skipped`` and ``scaler`` on the optimizer."""

    def state_dict(self) -> dict:
        """Everything needed to resume; projections are regenerated, never stored. ``settings`` records
        the rank, seed, distribution and masters setting (:meth:`_projection_fields`) and the algorithm
        and refresh setting (:meth:`_update_fields`) the row moments and masters belong to, which
        :meth:`load_state_dict` checks."""
        return {
            "kind": "logra",
            "settings": {**self._projection_fields(), **self._update_fields()},
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "row_moments": {k: v.clone() for k, v in self.row_moments.items()},
            "masters": {k: m.clone() for k, m in self.masters.items()},
            "native": self.native.state_dict(),
            **scaler_fields(self.scaler),
        }

    def sharded_state(self) -> SlotState:
        """Row moments (row-shaped) and target masters (parameter-shaped) as slots, the native
        AdamW's state under ``native.*``, counters as scalars (:mod:`megatron_logra.optim.state`).
        The scalars record the settings the state belongs to (:meth:`_projection_fields`,
        :meth:`_update_fields`) and which parameters it has slots for (:meth:`_slot_fields`), ahead
        of ``native`` (whose ``masters`` follows from them)."""
        native_scalars, slots = self.native.sharded_state("native")
        for t in self.targets:
            slots.append(ParamSlot("logra.row_moment", t.weight, self.row_moments[t.key], like="rows"))
            if t.key in self.masters:
                slots.append(ParamSlot("logra.master", t.weight, self.masters[t.key]))
        scalars = {"kind": "logra", "num_steps": self.num_steps, "num_skipped": self.num_skipped,
                   **self._projection_fields(), **self._update_fields(), **self._slot_fields(),
                   "native": native_scalars, **scaler_fields(self.scaler)}
        return scalars, slots

    def _slot_fields(self) -> dict:
        """Which parameters the state has slots for, the same on every rank and in every layout:
        ``targets``, the target kinds ``optimizer.logra.targets`` selects (aliases resolved to their
        Megatron kind, ``TARGET_ALIASES``; other names as given; sorted, without repeats: the targets
        have row moments, every other trained parameter AdamW moments), and ``native_freeze``, True
        when the native AdamW trains nothing (``optimizer.native.freeze=true``: no AdamW slots)."""
        return {"targets": sorted({TARGET_ALIASES.get(name, name) for name in self.cfg.targets}),
                "native_freeze": not self.native.params}

    def _projection_fields(self) -> dict:
        """The settings saved state belongs to: ``rank``, ``seed``, ``distribution`` (the projections
        the row moments were accumulated under) and ``masters`` (``fp32`` when this optimizer holds
        fp32 masters, else ``none``)."""
        return {"rank": self.cfg.rank, "seed": self.cfg.seed, "distribution": self.cfg.distribution,
                "masters": "fp32" if self.masters else "none"}

    def _update_fields(self) -> dict:
        """The settings a checkpoint's row moments were updated under, recorded in :meth:`sharded_state`:
        ``algorithm`` (``sgd`` never updates the row moments while the step counter runs on, so resuming it
        as ``row_adam`` would bias-correct zero moments as if they held every step) and ``refresh``
        (which projection the row moments pair with)."""
        return {"algorithm": self.cfg.algorithm, "refresh": self.cfg.refresh}

    def _check_projection(self, saved: dict, fields: tuple[str, ...], what: str) -> None:
        """``ValueError`` naming ``optimizer.logra.<field>`` when ``saved`` records another value of one of
        ``fields`` than this optimizer has; states that lack a field (older ones) pass."""
        here = {**self._projection_fields(), **self._update_fields()}
        for field_name in fields:
            value = saved.get(field_name)
            if value is not None and value != here[field_name] and field_name == "masters":
                raise ValueError(
                    f"{what} {'holds' if value == 'fp32' else 'holds no'} fp32 master weights (masters={value!r}), "
                    f"this run {'has' if here['masters'] == 'fp32' else 'has none'} (masters={here['masters']!r}); "
                    "model.params_dtype and optimizer.logra.masters decide it together (float32 weights never "
                    "have masters; 16-bit weights have them with optimizer.logra.masters=fp32): resume with the "
                    "settings the state was trained with")
            if value is not None and value != here[field_name]:
                why = ("the row moments were updated under that setting" if field_name in ("algorithm", "refresh")
                       else "the row moments belong to that projection")
                raise ValueError(f"{what} was trained with optimizer.logra.{field_name}={value!r}, this run has "
                                 f"{here[field_name]!r}; {why}: set optimizer.logra.{field_name}={value!r} "
                                 f"to resume it")

    def load_sharded_state(self, scalars: dict, slots: list[ParamSlot]) -> None:
        """Restore from :meth:`sharded_state`; refuses another rank, seed, distribution, algorithm or refresh
        setting (``ValueError``; a checkpoint that does not record algorithm / refresh, saved before they were,
        is accepted). (The masters setting is checked with the checkpoint's other settings before this is
        called.)"""
        _check_kind(scalars)
        self._check_projection(scalars, ("rank", "seed", "distribution", "algorithm", "refresh"), "the checkpoint")
        self.native.load_sharded_state(scalars["native"], [s for s in slots if s.name.startswith("native.")])
        self._restore_counters(scalars)

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`. Refuses (``ValueError`` naming the field) a state saved with
        another ``optimizer.logra`` rank, seed, distribution, masters, algorithm or refresh setting; a
        state that does not record them (saved before they were) is accepted. Row moments and masters must match in keys
        and shapes."""
        _check_kind(state)
        self._check_projection(state.get("settings", {}),
                               ("rank", "seed", "distribution", "masters", "algorithm", "refresh"), "the optimizer state")
        missing = sorted(set(self.row_moments) - set(state["row_moments"]))
        if missing:
            raise ValueError(f"optimizer state lacks row moments for targets {missing[:4]}{'...' if len(missing) > 4 else ''}")
        for k, v in self.row_moments.items():
            saved = state["row_moments"][k]
            if saved.shape != v.shape:
                raise ValueError(f"row moments of {k} have shape {tuple(saved.shape)}, expected {tuple(v.shape)}")
            v.copy_(saved)
        for k, m in self.masters.items():
            if k not in state["masters"]:
                raise ValueError(f"optimizer state lacks the fp32 master of {k}")
            m.copy_(state["masters"][k])
        self.native.load_state_dict(state["native"])
        self._restore_counters(state)

    def _restore_counters(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self.num_skipped = int(state.get("num_skipped", 0))
        restore_scaler(self.scaler, state)
        self.sketches.seek(self.num_steps)


def _check_kind(state: dict) -> None:
    if state.get("kind") != "logra":
        raise ValueError(f"optimizer state is of kind {state.get('kind')!r}, expected 'logra'")

"""Checkpoint state of :class:`~megatron_logra.optim.native.NativeAdamW` (the :class:`NativeAdamWState` mixin).

Contract: :meth:`~NativeAdamWState.state_dict` / :meth:`~NativeAdamWState.load_state_dict` save and install
AdamW's own state dict (parameter indices in AdamW's group order, ``param_order``) and the fp32 masters;
:meth:`~NativeAdamWState.sharded_state` / :meth:`~NativeAdamWState.load_sharded_state` do the same as
parameter-shaped slots plus scalars (:mod:`megatron_logra.optim.state`). On load the groups'
hyperparameters stay the resumed run's configuration (a changed learning rate is warned about by the
host's ``_warn_lr_change``). The host provides ``params``, ``masters``, ``inner`` (the AdamW, None without
parameters), ``_inner_order``, ``base_lr`` and ``_warn_lr_change``.
"""

from __future__ import annotations

import torch

from megatron_logra.optim.state import ParamSlot, SlotState

__all__ = ["NativeAdamWState"]


class NativeAdamWState:
    """Saving and installing NativeAdamW's moments, step counts and fp32 masters (a mixin)."""

    def state_dict(self) -> dict:
        """AdamW's own state dict (``inner``; its parameter indices follow ``param_order``, the
        positions of the parameters in AdamW's group order) and the fp32 masters."""
        inner = self.inner.state_dict() if self.inner is not None else None
        if inner is not None:  # the configured lr, not the step's scheduled one (torch's dict holds copies)
            for group in inner["param_groups"]:
                group["lr"] = self.base_lr
        state = {"inner": inner, "param_order": list(self._inner_order)}
        state["masters"] = [m.detach().clone() if m is not p else None for p, m in zip(self.params, self.masters)]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Install :meth:`state_dict` output: moments, step counts and fp32 masters. The groups'
        hyperparameters (lr, weight decay, betas, eps) stay this optimizer's, i.e. the resumed run's
        configuration, with a warning where the saved learning rate differs -- as
        :meth:`load_sharded_state` does (torch's own loader would put the saved ones back). A state
        saved with another parameter-group layout (a single group: saved before the no-decay group
        existed, or with ``weight_decay = 0``) is mapped parameter by parameter."""
        saved = state.get("inner")
        if self.inner is not None and saved is not None:
            order = state.get("param_order", list(range(len(self.params))))  # older states: one group
            same = ([len(g["params"]) for g in saved["param_groups"]] == [len(g["params"]) for g in self.inner.param_groups]
                    and list(order) == self._inner_order)
            configured = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
            if same:
                self.inner.load_state_dict(saved)
                for group, own in zip(self.inner.param_groups, configured):
                    group.update(own)
            else:
                self._load_remapped(saved, order)
            self._warn_lr_change(saved["param_groups"][0].get("lr"))
        for (p, m), saved in zip(zip(self.params, self.masters), state.get("masters", [])):
            if saved is not None and m is not p:
                m.copy_(saved)

    def _load_remapped(self, saved: dict, order: list[int]) -> None:
        flat_ids = [i for g in saved["param_groups"] for i in g["params"]]
        if len(flat_ids) != len(self.params) or sorted(order) != list(range(len(self.params))):
            raise ValueError(f"AdamW state of {len(flat_ids)} parameters does not fit this optimizer's "
                             f"{len(self.params)} parameters")
        self.inner.state.clear()
        for index, position in zip(flat_ids, order):
            st = saved["state"].get(index)
            if st:
                m = self.masters[position]
                self.inner.state[m] = {k: (v.to(device=m.device, dtype=m.dtype).clone()
                                           if torch.is_tensor(v) and k != "step" else
                                           (v.clone() if torch.is_tensor(v) else v)) for k, v in st.items()}

    def sharded_state(self, prefix: str = "native") -> SlotState:
        """Moments and fp32 masters as parameter-shaped slots; step count, lr and ``masters`` as
        scalars (see :mod:`megatron_logra.optim.state`). Moments not created yet are zeros, step 0.
        ``masters``: ``fp32`` when some parameter has an fp32 master (16-bit weights: a
        ``<prefix>.master`` slot), ``none`` when none has (float32 weights), which
        ``model.params_dtype`` decides; None without parameters (nothing to record). A checkpoint's
        is compared with the resumed run's before anything is loaded
        (:func:`megatron_logra.checkpoint.load.load_checkpoint`)."""
        masters = None
        if self.params:
            masters = "fp32" if any(m is not p for p, m in zip(self.params, self.masters)) else "none"
        scalars: dict = {"step": 0, "lr": None, "masters": masters}
        slots: list[ParamSlot] = []
        if self.inner is None:
            return scalars, slots
        scalars["lr"] = self.base_lr  # the configured lr: a schedule's current value is a function of the step
        for p, m in zip(self.params, self.masters):
            st = self.inner.state.get(m, {})
            if "step" in st:
                scalars["step"] = int(st["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                buf = st.get(name)
                slots.append(ParamSlot(f"{prefix}.{name}", p, buf if buf is not None else torch.zeros_like(m)))
            if m is not p:
                slots.append(ParamSlot(f"{prefix}.master", p, m))
        return scalars, slots

    def load_sharded_state(self, scalars: dict, slots: list[ParamSlot]) -> None:
        """Install ``slots`` (from :meth:`sharded_state`, filled from a checkpoint). The learning rate
        stays this optimizer's (the resumed run's configuration), with a warning where it changed."""
        if self.inner is None:
            return
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        for s in slots:
            by_param.setdefault(id(s.param), {})[s.name.rsplit(".", 1)[-1]] = s.tensor
        step = int(scalars.get("step", 0))
        self._warn_lr_change(scalars.get("lr"))
        for p, m in zip(self.params, self.masters):
            got = by_param.get(id(p), {})
            if m is not p and "master" in got and got["master"] is not m:
                m.copy_(got["master"])
            if step == 0:
                self.inner.state.pop(m, None)
                continue
            self.inner.state[m] = {
                "step": torch.tensor(float(step)),
                "exp_avg": got["exp_avg"],
                "exp_avg_sq": got["exp_avg_sq"],
            }
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

"""The native AdamW (non-target parameters) against ``torch.optim.AdamW`` as the reference.

* weight decay as Megatron's ``get_param_groups``: 2-D parameters decayed, 1-D ones (norm weights,
  biases) not; the reference is ``torch.optim.AdamW`` given those two groups by hand;
* the state (``state_dict`` and the sharded slots) round-trips with two groups, and a state saved
  with one group (before the no-decay group existed) still loads;
* the grad norm counts megatron's duplicate of tied embeddings (``shared``) once.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_logra.optim.native import NativeAdamW
from megatron_logra.parallel import ParallelGroups

HP = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6)
WD = 0.1


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)),  # a weight matrix: decayed
            torch.nn.Parameter(torch.randn(4, generator=g)),  # a bias: not decayed
            torch.nn.Parameter(1.0 + 0.1 * torch.randn(3, generator=g)),  # a norm weight: not decayed
            torch.nn.Parameter(torch.randn(2, 3, generator=g))]


def _grads(step: int, params) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _native(params, weight_decay=WD, lr=HP["lr"]) -> NativeAdamW:
    return NativeAdamW(params, lr=lr, betas=HP["betas"], eps=HP["eps"], weight_decay=weight_decay,
                       groups=ParallelGroups())


def _step(opt: NativeAdamW, step: int) -> None:
    for p, g in zip(opt.params, _grads(step, opt.params)):
        p.grad = g.clone()
    opt.step()


def _reference(params, steps: range, state=None):
    """torch.optim.AdamW with Megatron's two groups, on copies of ``params``."""
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    ref = torch.optim.AdamW([{"params": [copies[0], copies[3]]},
                             {"params": [copies[1], copies[2]], "weight_decay": 0.0}], weight_decay=WD, **HP)
    for step in steps:
        for c, g in zip(copies, _grads(step, copies)):
            c.grad = g
        ref.step()
    return [c.detach() for c in copies]


def test_weight_decay_spares_one_dimensional_parameters():
    params = _params()
    opt = _native(params)
    for step in range(1, 4):
        _step(opt, step)
    for got, want in zip(params, _reference(_params(), range(1, 4))):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-7)
    # zero gradients: only the decay acts, and only on the 2-D parameters
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.inner.state.clear()  # fresh moments: the Adam term is exactly 0 with zero gradients
    opt.step()
    assert torch.equal(params[1].detach(), before[1]) and torch.equal(params[2].detach(), before[2])
    torch.testing.assert_close(params[0].detach(), before[0] * (1 - HP["lr"] * WD), rtol=1e-7, atol=0)


def test_without_weight_decay_one_group_in_parameter_order():
    opt = _native(_params(), weight_decay=0.0)
    assert len(opt.inner.param_groups) == 1 and opt.inner.param_groups[0]["params"] == opt.masters


def test_set_lr_reaches_both_groups():
    opt = _native(_params())
    assert len(opt.inner.param_groups) == 2
    opt.set_lr(3e-4)
    assert [g["lr"] for g in opt.inner.param_groups] == [3e-4, 3e-4]
    assert [g["weight_decay"] for g in opt.inner.param_groups] == [WD, 0.0]


def test_state_dict_and_sharded_state_round_trip_with_two_groups():
    params = _params()
    opt = _native(params)
    for step in (1, 2):
        _step(opt, step)
    saved_weights = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())  # both hand out the optimizer's live tensors
    scalars, slots = opt.sharded_state()
    slot_values = [s.tensor.clone() for s in slots]
    _step(opt, 3)
    want = [p.detach().clone() for p in params]

    for load in ("state_dict", "sharded"):
        fresh_params = [torch.nn.Parameter(w.clone()) for w in saved_weights]
        fresh = _native(fresh_params)
        if load == "state_dict":
            fresh.load_state_dict(state)
        else:
            _, fresh_slots = fresh.sharded_state()
            for value, f in zip(slot_values, fresh_slots):
                f.tensor.copy_(value)
            fresh.load_sharded_state(scalars, fresh_slots)
        _step(fresh, 3)
        for got, w in zip(fresh_params, want):
            assert torch.equal(got.detach(), w), load


def test_a_single_group_state_from_before_the_no_decay_group_loads():
    """States saved by the one-group AdamW (parameter indices in parameter order) map onto the two groups."""
    params = _params()
    old = torch.optim.AdamW(params, weight_decay=WD, **HP)  # the former layout: one group, every param decayed
    for step in (1, 2):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        old.step()
    legacy = {"inner": old.state_dict(), "masters": [None] * 4}
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _native(fresh_params, lr=5e-3)
    fresh.load_state_dict(legacy)
    assert [g["lr"] for g in fresh.inner.param_groups] == [5e-3] * 2  # this run's lr, as from a checkpoint
    assert [g["weight_decay"] for g in fresh.inner.param_groups] == [WD, 0.0]
    for p, f in zip(params, fresh_params):
        st, fst = old.state[p], fresh.inner.state[f]
        assert float(fst["step"]) == 2.0
        assert torch.equal(fst["exp_avg"], st["exp_avg"]) and torch.equal(fst["exp_avg_sq"], st["exp_avg_sq"])
    _step(fresh, 3)
    # continuing: the two-group reference from the same moments
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    ref = torch.optim.AdamW([{"params": [copies[0], copies[3]]},
                             {"params": [copies[1], copies[2]], "weight_decay": 0.0}], weight_decay=WD,
                            **{**HP, "lr": 5e-3})
    for c, p in zip(copies, params):
        ref.state[c] = {k: v.clone() for k, v in old.state[p].items()}
    for c, g in zip(copies, _grads(3, copies)):
        c.grad = g
    ref.step()
    for got, want in zip(fresh_params, copies):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=1e-7)


def test_grad_norm_counts_the_last_stages_copy_of_tied_embeddings_not_at_all():
    """Under PP > 1 with tied embeddings megatron keeps a copy of the word embeddings on the last stage
    (``shared`` and ``shared_embedding``), whose gradient after the embedding-group sum equals the first
    stage's: the global norm² counts it on the first stage only, as megatron's ``param_is_not_shared``.
    (Measured with 2 stages over gloo: grad norm 7.9018 with the copy counted, 7.6556 without, and
    7.6556 in one process.)"""
    first_stage_embedding, last_stage_copy, other = _params()[:3]
    first_stage_embedding.shared_embedding = True
    last_stage_copy.shared_embedding = True
    last_stage_copy.shared = True
    opt = _native([first_stage_embedding, last_stage_copy, other])
    for p, g in zip(opt.params, _grads(1, opt.params)):
        p.grad = g
    want = sum(float(p.grad.double().pow(2).sum()) for p in (first_stage_embedding, other))
    assert float(opt.local_norm2(torch.device("cpu"))) == pytest.approx(want, rel=1e-12)


def test_both_loaders_keep_this_runs_hyperparameters(caplog):
    """``load_state_dict`` and ``load_sharded_state`` (what checkpoints use) agree: the moments and
    step come from the saved state, lr / weight decay / betas / eps from this run's configuration
    (torch's own loader would restore the saved ones), with a warning naming both learning rates."""
    params = _params()
    opt = _native(params)
    _step(opt, 1)
    _step(opt, 2)
    state = copy.deepcopy(opt.state_dict())
    scalars, slots = opt.sharded_state()
    new = dict(lr=1e-3, weight_decay=0.5, betas=(0.8, 0.99), eps=1e-6)
    got = {}
    for load in ("state_dict", "sharded"):
        fresh = NativeAdamW([torch.nn.Parameter(p.detach().clone()) for p in params], groups=ParallelGroups(),
                            **new)
        caplog.clear()
        with caplog.at_level("WARNING", logger="megatron_logra.optim.native"):
            if load == "state_dict":
                fresh.load_state_dict(state)
            else:
                _, fresh_slots = fresh.sharded_state()
                for value, f in zip(slots, fresh_slots):
                    f.tensor.copy_(value.tensor)
                fresh.load_sharded_state(scalars, fresh_slots)
        assert f"at lr {new['lr']:g}" in caplog.text and f"saved at lr {HP['lr']:g}" in caplog.text, load
        got[load] = [(g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in fresh.inner.param_groups]
        assert all(float(st["step"]) == 2.0 for st in fresh.inner.state.values()), load
    want = [(new["lr"], new["weight_decay"], new["betas"], new["eps"]), (new["lr"], 0.0, new["betas"], new["eps"])]
    assert got["state_dict"] == got["sharded"] == want

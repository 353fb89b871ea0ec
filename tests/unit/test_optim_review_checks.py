"""Refusals of the LoGRA optimizer's config and state (CPU, one rank):

* fp16 targets with ``logra.masters=none`` and ``logra.rounding=stochastic`` (stochastic rounding exists
  for bf16 only; fp16 would silently round to nearest);
* :meth:`LograOptimizer.load_state_dict` of a state saved with another rank / seed / distribution /
  masters setting (as the sharded checkpoint path refuses);
* ``logra.recipe=paper`` with an explicitly set ``optimizer.logra.lr`` / ``weight_decay`` / ``clip_grad``,
  which that recipe does not read.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from megatron_logra.optim import LograConfig, LograOptimizer, NativeConfig
from megatron_logra.parallel import ParallelGroups

GROUPS = ParallelGroups()


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("linear_fc1", nn.Linear(16, 16, bias=False))
    return m.to(dtype)


def _opt(model: nn.Module, **kw) -> LograOptimizer:
    kw.setdefault("rank", 4)
    return LograOptimizer(model, LograConfig(targets=["linear_fc1"], **kw), NativeConfig(freeze=True), GROUPS)


# ------------------------------------------------------------------------------ fp16 rounding
def test_fp16_targets_without_masters_and_stochastic_rounding_are_refused():
    model = _model(torch.float16)
    with pytest.raises(ValueError, match=r"optimizer\.logra\.masters=none with optimizer\.logra\.rounding=stochastic "
                                         r"needs bf16 .*float16 \(e\.g\. linear_fc1\).*bf16 only.*"
                                         r"set optimizer\.logra\.masters=fp32"):
        _opt(model, masters="none", rounding="stochastic")
    assert not model.linear_fc1._forward_hooks  # the refused optimizer left no sketch hook behind


@pytest.mark.parametrize("dtype, masters, rounding", [
    (torch.float16, "fp32", "stochastic"), (torch.float16, "none", "nearest"),
    (torch.bfloat16, "none", "stochastic"), (torch.float32, "none", "stochastic"),
])
def test_other_precision_settings_are_accepted_and_in_effect(dtype, masters, rounding):
    def one_step(rounding):
        model = _model(dtype)
        before = model.linear_fc1.weight.detach().clone()
        opt = _opt(model, masters=masters, rounding=rounding)
        torch.manual_seed(1)
        opt.zero_grad()
        model(torch.randn(3, 16, dtype=dtype)).float().sum().backward()
        opt.step()
        return opt, before, model.linear_fc1.weight.detach()

    opt, before, w = one_step(rounding)
    assert (opt.cfg.masters, opt.cfg.rounding) == (masters, rounding)
    assert w.dtype == dtype and torch.isfinite(w).all() and not torch.equal(w, before)  # one step ran
    if masters == "fp32":
        master = opt.masters["linear_fc1"]
        assert master.dtype == torch.float32 and torch.equal(w, master.to(dtype))  # weight = master to nearest
    else:
        assert opt.masters == {}
    if rounding == "stochastic" and masters == "none":
        _, _, nearest = one_step("nearest")
        if dtype == torch.bfloat16:  # stochastic rounding: some entries land on the other neighbour
            diff = (w.float() - nearest.float()).abs()
            assert diff.max() > 0 and (diff <= nearest.float().abs() * 2.0**-7).all()  # at most one bf16 spacing
        else:  # fp32 weights are updated in place: rounding does not apply
            assert torch.equal(w, nearest)


# ------------------------------------------------------------------------------ load_state_dict
def _trained_state(**kw) -> dict:
    model = _model(kw.pop("dtype", torch.float32))
    opt = _opt(model, **kw)
    opt.zero_grad()
    model(torch.randn(3, 16, dtype=model.linear_fc1.weight.dtype)).float().sum().backward()
    opt.step()
    return opt.state_dict()


def test_state_dict_records_the_projection_settings():
    state = _trained_state(rank=4, seed=1)  # fp32 weights: no masters to keep, whatever logra.masters says
    assert state["settings"] == {"rank": 4, "seed": 1, "distribution": "rademacher", "masters": "none",
                                 "algorithm": "row_adam", "refresh": True}


@pytest.mark.parametrize("field, here, saved", [
    ("rank", dict(rank=8, seed=1), "4"), ("seed", dict(rank=4, seed=99), "1"),
    ("distribution", dict(rank=4, seed=1, distribution="gaussian"), "'rademacher'"),
    ("algorithm", dict(rank=4, seed=1, algorithm="sgd"), "'row_adam'"),
    ("refresh", dict(rank=4, seed=1, refresh=False), "True"),
])
def test_load_state_dict_refuses_another_projection(field, here, saved):
    state = _trained_state(rank=4, seed=1)
    opt = _opt(_model(), **here)
    with pytest.raises(ValueError, match=rf"the optimizer state was trained with optimizer\.logra\.{field}={saved}, "
                                         rf"this run has .*set optimizer\.logra\.{field}={saved} to resume it"):
        opt.load_state_dict(state)
    assert opt.num_steps == 0


def test_load_state_dict_refuses_another_masters_setting():
    state = _trained_state(dtype=torch.bfloat16, masters="fp32", seed=1)
    assert state["settings"]["masters"] == "fp32"
    opt = _opt(_model(torch.bfloat16), masters="none", seed=1)
    with pytest.raises(ValueError, match=r"holds fp32 master weights \(masters='fp32'\), this run has none "
                                         r"\(masters='none'\); model\.params_dtype and optimizer\.logra\.masters"):
        opt.load_state_dict(state)


def test_fp32_weight_state_into_a_bf16_run_names_the_weights_dtype_not_only_masters():
    """An fp32-weight run holds no masters even when configured with ``masters=fp32``: the refusal must
    name ``model.params_dtype`` (advising ``masters=none`` alone would switch the run to bf16-only weights)."""
    state = _trained_state(dtype=torch.float32, masters="fp32", seed=1)
    assert state["settings"]["masters"] == "none"
    opt = _opt(_model(torch.bfloat16), masters="fp32", seed=1)
    with pytest.raises(ValueError, match=r"holds no fp32 master weights.*model\.params_dtype") as info:
        opt.load_state_dict(state)
    assert "set optimizer.logra.masters='none'" not in str(info.value)
    assert opt.num_steps == 0


def test_load_state_dict_accepts_the_same_settings_and_older_states():
    state = _trained_state(rank=4, seed=1)
    opt = _opt(_model(), rank=4, seed=1)
    opt.load_state_dict(state)
    assert opt.num_steps == 1
    older = {k: v for k, v in state.items() if k != "settings"}
    opt = _opt(_model(), rank=4, seed=1)
    opt.load_state_dict(older)
    assert opt.num_steps == 1


# ------------------------------------------------------------------------------ paper recipe fields
@pytest.mark.parametrize("field, value", [("weight_decay", "0.1"), ("clip_grad", "0.5"), ("lr", "5")])
def test_paper_recipe_refuses_explicit_unused_fields(field, value):
    from megatron_logra.config import parse_args_to_config

    for order in ([f"optimizer.logra.{field}={value}", "optimizer.logra.recipe=paper"],
                  ["optimizer.logra.recipe=paper", f"optimizer.logra.{field}={value}"]):
        with pytest.raises(ValueError, match=rf"optimizer\.logra\.{field}={float(value)} is set, but "
                                             rf"optimizer\.logra\.recipe=paper does not use it .*remove "
                                             rf"optimizer\.logra\.{field}"):
            parse_args_to_config("tiny", order)


def test_paper_recipe_still_accepts_recipe_values_defaults_and_the_dense_optimizer():
    from megatron_logra.config import parse_args_to_config

    # the tiny recipe sets logra.lr=1e-4 for its optimizer recipe: switching it to paper is fine
    cfg = parse_args_to_config("tiny", ["optimizer.logra.recipe=paper", "optimizer.logra.update_ratio=2e-3"])
    assert cfg.optimizer.logra.recipe == "paper"
    # assigning a field its default implies nothing the recipe would ignore
    parse_args_to_config("tiny", ["optimizer.logra.recipe=paper", "optimizer.logra.weight_decay=0",
                                  "optimizer.logra.clip_grad=1.0", "optimizer.logra.lr=1e-3"])
    # the dense AdamW (optimizer.name=adam) does clip at logra.clip_grad
    parse_args_to_config("tiny-adam", ["optimizer.logra.recipe=paper", "optimizer.logra.clip_grad=0.5"])
    # a named recipe's own values are not given by the user
    assert parse_args_to_config("tiny", ["optimizer.logra.recipe=paper"]).optimizer.logra.lr == 1e-4


def test_paper_recipe_refuses_a_recipe_files_unused_field(tmp_path):
    from megatron_logra.config import parse_args_to_config

    recipe = tmp_path / "paper.yaml"
    recipe.write_text("recipe: tiny\noptimizer:\n  logra:\n    recipe: paper\n    weight_decay: 0.1\n")
    with pytest.raises(ValueError, match=r"optimizer\.logra\.weight_decay=0\.1 is set in recipe file .*paper\.yaml, "
                                         r"but optimizer\.logra\.recipe=paper does not use it"):
        parse_args_to_config(str(recipe), [])

"""The predicted KL covers the native AdamW part of a step (trained non-target parameters).

``LograOptimizer.apply(update, α)`` changes the targets by ``−α·D·A`` *and* the trained non-target
parameters (embeddings, norms, biases, output layer) by ``α·Δθ`` (``logra.scale_native``). The probes
must see both:

* ``adamw_delta`` (the change one AdamW step would make, not taken) against ``torch.optim.AdamW``'s
  actual step as the independent reference: float64, several steps, decoupled decay, bias correction
  at step 1 and later; ``NativeAdamW.planned_deltas`` against its own ``step`` (fp32 and bf16 masters,
  two parameter groups, ``scale``);
* on a megatron-core GPT with trained non-targets, forward-mode and finite-difference predictions
  against the exact KL of the step applied by the optimizer with a small α (reference: float64
  ``F.kl_div`` of the logits before and after). Measured: JVP 1.001 (untied) / 1.000 (tied), finite
  difference (h = 1, central differences across the α = 1 step) 1.030 / 1.015; the targets-only
  prediction of the former code was 27× / 15× too small;
* the finite-difference perturbation of parameters restores bf16 values bit for bit;
* ``logra.scale_native=false`` with trained non-targets and a KL controller is refused by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_logra.kl.fd_probe import predicted_kl_fd, shifted_parameters
from megatron_logra.kl.probe import ProbeBatch, predicted_kl
from megatron_logra.optim.functional import adamw_delta
from megatron_logra.optim.native import NativeAdamW
from megatron_logra.parallel import ParallelGroups

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 1e-2, 0.1


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


# --------------------------------------------------------------------------- the pure AdamW change


@pytest.mark.parametrize("weight_decay", [0.0, WD])
def test_adamw_delta_is_the_change_torch_adamw_makes(weight_decay):
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, 7, generator=gen, dtype=torch.float64).requires_grad_(True)
    ref = torch.optim.AdamW([theta], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)
    for step in range(4):  # step 0: no moments yet, bias corrections 1−β¹; later ones from the state
        grad = torch.randn(5, 7, generator=gen, dtype=torch.float64) * (10.0 ** (step - 2))
        st = ref.state.get(theta, {})
        inputs = [theta.detach().clone(), grad.clone()] + [st[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in st]
        delta = adamw_delta(theta.detach(), grad, st.get("exp_avg"), st.get("exp_avg_sq"),
                            int(st["step"]) if st else 0, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                            weight_decay=weight_decay)
        # nothing modified
        now = [theta.detach(), grad] + [st[k] for k in ("exp_avg", "exp_avg_sq") if k in st]
        assert all(torch.equal(a, b) for a, b in zip(inputs, now))
        before = theta.detach().clone()
        theta.grad = grad
        ref.step()
        torch.testing.assert_close(delta, theta.detach() - before, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="step"):
        adamw_delta(theta.detach(), grad, None, None, -1, lr=LR, beta1=0.9, beta2=0.95, eps=EPS, weight_decay=0.0)


def test_planned_deltas_are_the_native_step():
    """fp32 and bf16 (fp32-master) parameters, decayed and not, over three steps, with ``scale``."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(6, 4, generator=gen)),
              torch.nn.Parameter(torch.randn(6, generator=gen)),
              torch.nn.Parameter(torch.randn(3, 4, generator=gen).bfloat16()),
              torch.nn.Parameter(torch.randn(4, generator=gen).bfloat16())]
    opt = NativeAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, groups=ParallelGroups())
    assert len(opt.inner.param_groups) == 2
    for step, scale in enumerate((1.0, 1.0, 0.3)):
        for p in params:
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            if p.dtype == torch.float32:
                p.grad = g
            else:
                p.main_grad.copy_(g.float())
        planned = opt.planned_deltas()
        assert [p for p, _ in planned] == params and all(d.dtype == torch.float32 for _, d in planned)
        before = [m.detach().clone() for m in opt.masters]
        opt.step(scale=scale)
        for (p, delta), m, b in zip(planned, opt.masters, before):
            assert delta.abs().max() > 1e-3  # an AdamW step moves every element by ~lr
            torch.testing.assert_close(m.detach() - b, scale * delta, rtol=0, atol=1e-6, msg=f"step {step}")
    assert NativeAdamW([], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, groups=ParallelGroups()).planned_deltas() == []


def test_shifted_parameters_restore_bf16_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.randn(64, generator=gen).bfloat16())
    q = torch.nn.Parameter(torch.randn(8, 3, generator=gen))
    original = [p.detach().clone(), q.detach().clone()]
    native = [(p, torch.randn(64, generator=gen) * 1e-3), (q, torch.randn(8, 3, generator=gen))]
    for h in (2.5, -2.5):
        with shifted_parameters(native, h):
            assert torch.equal(p, (original[0].float() + h * native[0][1]).bfloat16())
            torch.testing.assert_close(q.detach(), original[1] + h * native[1][1], rtol=0, atol=1e-6)
        assert torch.equal(p, original[0]) and torch.equal(q, original[1])
    with pytest.raises(RuntimeError, match="boom"):  # restored on an error inside, too
        with shifted_parameters(native, 1.0):
            raise RuntimeError("boom")
    assert torch.equal(p, original[0]) and torch.equal(q, original[1])


# --------------------------------------------------------------------------- on a megatron GPT

B, S, V = 2, 16, 64
ALPHA = 0.05


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_prediction_with_trained_native_parameters_matches_the_applied_step(groups, tie):
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.train.step import Batch, forward_backward

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(ModelConfig(init_std=0.1, vocab_size=V, add_bias_linear=True,
                                      untie_embeddings_and_output_weights=not tie), groups, seed=3)
    opt = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=8, recipe="paper", update_ratio=1e-3),
                                                 native=NativeConfig(lr=1e-3)), groups)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)
    pos = torch.arange(S)[None].expand(B, S).contiguous()
    mask = torch.ones(B, S)
    mask[:, :4] = 0.0
    opt.zero_grad()
    r = forward_backward(model, [Batch(tokens, labels, mask, pos)], groups)
    update = opt.prepare(num_tokens=r.num_tokens)
    probe = ProbeBatch(tokens, pos, mask)

    native = opt.native_deltas(update)
    names = {id(p): n for n, p in model.named_parameters()}
    trained = {names[id(p)] for p, _ in native}
    assert "embedding.word_embeddings.weight" in trained and "decoder.final_layernorm.weight" in trained
    assert ("output_layer.weight" in trained) == (not tie)  # tied at PP = 1: one parameter, both uses
    assert any(n.endswith("linear_qkv.bias") for n in trained)  # a bias added inside megatron's linear Function

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    jvp, old_logits = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups,
                                   native=native)
    fd, _ = predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, native=native)
    targets_only, _ = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe, groups)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the probes changed nothing

    opt.apply(update, ALPHA)
    with torch.no_grad():
        new_logits = model(tokens, pos, None)[mask.bool()]
    # independent exact KL(π_old ‖ π_new), float64
    exact = F.kl_div(F.log_softmax(new_logits.double(), -1), F.log_softmax(old_logits.double(), -1),
                     log_target=True, reduction="none").sum(-1).mean().item()
    assert abs(exact / (ALPHA**2 * jvp) - 1.0) <= 0.01, (exact, ALPHA**2 * jvp)
    assert abs(exact / (ALPHA**2 * fd) - 1.0) <= 0.05, (exact, ALPHA**2 * fd)
    assert abs(fd / jvp - 1.0) <= 0.05, (fd, jvp)
    assert exact / (ALPHA**2 * targets_only) > 5.0  # what leaving the native step out missed


def test_native_deltas_are_empty_for_frozen_non_targets_and_refused_unscaled(groups):
    from torch import nn

    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer

    def prepared(native: NativeConfig, **logra):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        opt = build_optimizer(m, OptimizerConfig(logra=LograConfig(rank=4, targets=["0", "2"], **logra),
                                                 native=native), ParallelGroups())
        opt.zero_grad()
        m(torch.randn(16, 8)).pow(2).sum().backward()
        return opt, opt.prepare(num_tokens=16)

    opt, update = prepared(NativeConfig(freeze=True))
    assert opt.native_deltas(update) == []
    opt, update = prepared(NativeConfig(), scale_native=False)
    with pytest.raises(ValueError, match="optimizer.logra.scale_native"):
        opt.native_deltas(update)


def test_rl_job_refuses_unscaled_native_steps_under_kl_control(monkeypatch):
    """Checked from the configuration, before process groups, model or rollouts exist."""
    import megatron_logra.rl.components as components
    from megatron_logra.config import load_recipe

    def too_far(*args, **kwargs):
        raise AssertionError("build_components went past the check")

    monkeypatch.setattr(components, "initialize_parallel", too_far)
    cfg = load_recipe("tiny")
    cfg.optimizer.native.freeze, cfg.optimizer.logra.scale_native = False, False
    assert cfg.kl.mode != "none"
    with pytest.raises(ValueError, match=r"^optimizer\.logra\.scale_native=false .*kl\.mode=none"):
        components.build_components(cfg)
    for fix in ({"scale_native": True}, {"freeze": True}, {"mode": "none"}):
        cfg = load_recipe("tiny")
        cfg.optimizer.native.freeze, cfg.optimizer.logra.scale_native = False, False
        if "scale_native" in fix:
            cfg.optimizer.logra.scale_native = True
        if "freeze" in fix:
            cfg.optimizer.native.freeze = True
        if "mode" in fix:
            cfg.kl.mode, cfg.kl.measure_actual = "none", False
        components.check_native_step_control(cfg)  # accepted


def test_finite_difference_control_of_a_bf16_step_with_trained_natives_keeps_the_budget(groups):
    """bf16 targets at the paper's 6e-5 relative update take a finite-difference step h ≫ 1 (their
    outputs cannot resolve less); the trained natives' AdamW change is relatively ~100× larger and
    takes its own step. The controlled step's exact KL must then land on the budget, as with the
    forward-mode probe (a shared h ≈ 83 predicted ~20× too little and overshot the budget ~8×)."""
    from megatron_logra.kl.controller import KLConfig, KLController
    from megatron_logra.kl.probe import measure_kl
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.rl.loop import fd_steps
    from megatron_logra.train.step import Batch, forward_backward

    kl = KLConfig(mode="predicted", probe="finite_difference", budget_start=2e-4)
    results = {}
    for method in ("jvp", "fd"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_gpt(ModelConfig(init_std=0.02, vocab_size=V, params_dtype="bfloat16"), groups, seed=3)
        opt = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=8, recipe="paper", update_ratio=6e-5),
                                                     native=NativeConfig(lr=1e-3)), groups)
        gen = torch.Generator().manual_seed(0)
        tokens, labels = torch.randint(0, V, (4, 32), generator=gen), torch.randint(0, V, (4, 32), generator=gen)
        pos = torch.arange(32)[None].expand(4, 32).contiguous()
        mask = torch.ones(4, 32)
        mask[:, :4] = 0.0
        for _ in range(3):
            opt.zero_grad()
            opt.step(num_tokens=forward_backward(model, [Batch(tokens, labels, mask, pos)], groups).num_tokens)
        opt.zero_grad()
        update = opt.prepare(num_tokens=forward_backward(model, [Batch(tokens, labels, mask, pos)], groups).num_tokens)
        probe = ProbeBatch(tokens, pos, mask)
        native = opt.native_deltas(update)
        assert native
        if method == "jvp":
            pred, old_logits = predicted_kl(model, opt.sketches, update.directions, update.update_index, probe,
                                            groups, native=native)
        else:
            h, h_native = fd_steps(kl, opt, opt.relative_update_norm(update, 1.0), native)
            assert h > 20 and 1.0 <= h_native < h / 10  # each part's step fits its own relative change
            pred, old_logits = predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, step=h,
                                               native=native, native_step=h_native)
        alpha, budget = KLController(kl).step_size(pred, 1)
        assert alpha < kl.alpha_max  # the budget, not the α cap, sets the step
        opt.apply(update, alpha)
        results[method] = (pred, measure_kl(model, probe, old_logits, groups) / budget)
        opt.sketches.remove()
        opt.native.remove_hooks()
    assert abs(results["fd"][0] / results["jvp"][0] - 1.0) < 0.25, results
    for method, (_, ratio) in results.items():
        assert 0.6 < ratio < 1.5, (method, results)  # exact KL of the applied step / budget


def test_every_pipeline_stage_runs_the_same_number_of_probe_forwards(groups):
    """The number of finite-difference forwards depends on the steps alone (the same on every rank of
    the model-parallel group), never on whether this rank holds trained non-targets: pipeline stages
    exchange activations in every forward, so a stage without natives must run the native pair too.
    Frozen natives everywhere keep one joint difference (three forwards)."""
    from megatron_logra.kl.controller import KLConfig
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.rl.loop import fd_steps
    from megatron_logra.train.step import Batch, forward_backward

    counts = {}
    for freeze in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_gpt(ModelConfig(init_std=0.02, vocab_size=V, params_dtype="bfloat16"), groups, seed=3)
        opt = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=8, recipe="paper", update_ratio=6e-5),
                                                     native=NativeConfig(freeze=freeze)), groups)
        gen = torch.Generator().manual_seed(0)
        tokens, labels = torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)
        pos = torch.arange(S)[None].expand(B, S).contiguous()
        mask = torch.ones(B, S)
        update = opt.prepare(num_tokens=forward_backward(model, [Batch(tokens, labels, mask, pos)], groups).num_tokens)
        native = opt.native_deltas(update)
        h, h_native = fd_steps(KLConfig(), opt, opt.relative_update_norm(update, 1.0), native)
        assert (h_native == h) == freeze  # frozen natives: one joint difference
        seen = []
        handle = model.register_forward_hook(lambda *_: seen.append(1))
        probe = ProbeBatch(tokens, pos, mask)
        predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, step=h, native=native,
                        native_step=h_native)
        # a stage holding no trained non-targets, with the same steps: the same forwards
        predicted_kl_fd(model, opt.sketches, update.directions, probe, groups, step=h, native=(),
                        native_step=h_native)
        handle.remove()
        counts[freeze] = len(seen)
        opt.sketches.remove()
        opt.native.remove_hooks()
    assert counts == {False: 10, True: 6}

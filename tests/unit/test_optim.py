"""Tests of the LoGRA optimizer (DESIGN §1, "Optimizer (RowAdam)") against naive references.

Every expectation is computed here, independently of the code under test: dense gradients
come from an ordinary float64 copy of the model (taken *before* the optimizer freezes the
targets and installs its hooks), RowAdam is a per-row Python loop, clipping norms are
``‖(G·Aᵀ)·A‖²`` summed naively, native parameters are stepped by ``torch.optim.AdamW``.
The only thing read from the optimizer to build a reference is the projection ``A``
(``opt.sketches.projection_for(target, update_index)``), which is an input of the method.

Tolerances: the optimizer works in fp32 (weights, sketches, GEMMs of length <= 40), so a
computed update carries a relative error of order 1e-6; updates under test are >= 1e-4 in
absolute size, so ``rtol=1e-5, atol=1e-6`` on weights separates a correct update from any
wrong formula by orders of magnitude (each test also asserts its update is far larger than
its tolerance). Statistical checks state their bound next to the assertion.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from megatron_logra.optim import DenseAdamW, LograConfig, NativeConfig, OptimizerConfig
from megatron_logra.optim.functional import (
    apply_low_rank_update_,
    reconstructed_norm2,
    row_adam_direction,
)
from support.optim_models import single_thread  # noqa: F401  (an autouse fixture)
from support.optim_models import (
    F64, GROUPS, DenseRef, make_batch, make_logra, make_mlp, mean_loss, naive_row_adam, proj, snapshot, sum_loss,
)


# --------------------------------------------------------------------------- 1. RowAdam core


@pytest.mark.parametrize("dtype,rtol", [(F64, 1e-12), (torch.float32, 2e-6)])
def test_row_adam_direction_matches_per_row_loop_over_steps(dtype, rtol):
    gen = torch.Generator().manual_seed(0)
    beta2, eps = 0.9, 1e-3  # a large eps so a wrong ε placement is visible
    v = torch.zeros(7, dtype=dtype)
    v_ref = torch.zeros(7, dtype=F64)
    ptr = v.data_ptr()
    for step in range(1, 5):
        S = (torch.randn(7, 5, generator=gen, dtype=F64) * torch.logspace(-2, 1, 7, dtype=F64)[:, None]).to(dtype)
        D = row_adam_direction(S, v, step, beta2, eps)
        D_ref, v_ref = naive_row_adam(S.double(), v_ref, step, beta2, eps)
        assert v.data_ptr() == ptr, "v must be updated in place"
        torch.testing.assert_close(v.double(), v_ref, rtol=rtol, atol=0.0)
        torch.testing.assert_close(D.double(), D_ref, rtol=rtol, atol=0.0)
        assert D.shape == S.shape


def test_row_adam_direction_rejects_step_zero_without_touching_v():
    v = torch.ones(3)
    with pytest.raises(ValueError, match="step"):
        row_adam_direction(torch.ones(3, 2), v, 0, 0.95, 1e-8)
    assert torch.equal(v, torch.ones(3))


# --------------------------------------------------------------------------- 2. reconstructed norm


def test_reconstructed_norm2_equals_frobenius_and_column_shares_add_up():
    gen = torch.Generator().manual_seed(1)
    S = torch.randn(9, 6, generator=gen)
    A = torch.randn(6, 23, generator=gen) / math.sqrt(6)
    full = reconstructed_norm2(S, A)
    expected = (S.double() @ A.double()).pow(2).sum()
    assert full.dtype == F64 and full.dim() == 0
    torch.testing.assert_close(full, expected, rtol=1e-12, atol=0.0)
    bounds = [0, 4, 5, 15, 23]  # an uneven partition of the columns
    shares = [reconstructed_norm2(S, A[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    for (a, b), share in zip(zip(bounds[:-1], bounds[1:]), shares):
        torch.testing.assert_close(share, (S.double() @ A[:, a:b].double()).pow(2).sum(), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(sum(shares), expected, rtol=1e-12, atol=0.0)


# --------------------------------------------------------------------------- low-rank apply


def test_apply_low_rank_update_fp32_and_master_paths():
    gen = torch.Generator().manual_seed(2)
    # exactly representable data: every fp32 result below is exact
    W = torch.randint(-64, 64, (10, 8), generator=gen).float() / 32
    F = torch.randint(-8, 8, (10, 4), generator=gen).float() / 64
    A = (torch.randint(0, 2, (4, 8), generator=gen).float() * 2 - 1) * 0.5
    exact = 0.5 * W.double() - F.double() @ A.double()

    w = W.clone()
    apply_low_rank_update_(w, F, A, decay=0.5)
    assert torch.equal(w.double(), exact)

    master = W.clone()
    wb = W.to(torch.bfloat16)
    apply_low_rank_update_(wb, F, A, decay=0.5, master=master)
    assert torch.equal(master.double(), exact)
    assert torch.equal(wb, master.to(torch.bfloat16))

    # a 16-bit weight without a master belongs to the merge kernel (low_rank_merge_)
    with pytest.raises(ValueError, match="low_rank_merge_"):
        apply_low_rank_update_(W.to(torch.bfloat16), F, A)


# --------------------------------------------------------------------------- 3. SGD and RowAdam on models


@pytest.mark.parametrize("token_sum", [False, True], ids=["mean-loss", "sum-loss-num-tokens"])
def test_sgd_update_is_projected_dense_gradient_sequential_leaf_targets(token_sum):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 8))
    ref = DenseRef(model)
    w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    lr = 0.05
    opt = make_logra(model, targets=("0", "2"), rank=6, algorithm="sgd", lr=lr)
    assert sorted(t.module_name for t in opt.targets) == ["0", "2"]
    assert not model[0].weight.requires_grad and not model[2].weight.requires_grad
    x, y = make_batch(1, (4, 3), 12, 8)
    loss_fn = sum_loss if token_sum else mean_loss
    num_tokens = 12 if token_sum else None

    opt.zero_grad()
    loss_fn(model, x, y).backward()
    update = opt.step(num_tokens=num_tokens)
    assert not update.skipped and update.step == 1 and update.update_index == 0

    grads = ref.grads(x, y, loss_fn)
    for t in opt.targets:
        A = proj(opt, t, 0)
        assert A.shape == (6, t.weight.shape[1])
        G = grads[f"{t.module_name}.weight"] / (num_tokens or 1)
        S = G @ A.T
        expected = w0[f"{t.module_name}.weight"] - lr * S @ A
        assert (expected - w0[f"{t.module_name}.weight"]).abs().max() > 1e-3
        torch.testing.assert_close(t.weight.double(), expected, rtol=1e-5, atol=1e-6)


def test_row_adam_three_steps_match_naive_reference_with_refresh():
    model = make_mlp(0)
    ref = DenseRef(model)
    lr, beta2, eps = 0.02, 0.9, 1e-8
    opt = make_logra(model, algorithm="row_adam", lr=lr, beta2=beta2, eps=eps, refresh=True)
    W = {t.key: t.weight.detach().double().clone() for t in opt.targets}
    v = {t.key: torch.zeros(t.weight.shape[0], dtype=F64) for t in opt.targets}
    prev_A: dict[str, torch.Tensor] = {}
    for step in range(1, 4):
        for t in opt.targets:
            ref.set_(f"{t.module_name}.weight", W[t.key])
        x, y = make_batch(10 + step, (6,))
        opt.zero_grad()
        mean_loss(model, x, y).backward()
        update = opt.step()
        assert (update.step, update.update_index) == (step, step - 1)
        grads = ref.grads(x, y, mean_loss)
        for t in opt.targets:
            A = proj(opt, t, step - 1)
            if t.key in prev_A:
                assert not torch.equal(A, prev_A[t.key]), "refresh: A must change every step"
            prev_A[t.key] = A
            S = grads[f"{t.module_name}.weight"] @ A.T
            D, v[t.key] = naive_row_adam(S, v[t.key], step, beta2, eps)
            delta = lr * D @ A
            assert delta.abs().max() > 1e-3
            W[t.key] = W[t.key] - delta
            torch.testing.assert_close(t.weight.double(), W[t.key], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(opt.row_moments[t.key].double(), v[t.key], rtol=1e-4, atol=1e-12)


# --------------------------------------------------------------------------- 4. orthonormal A = exact SGD


class Funnel(nn.Module):
    """Two targets that both read 16 features (so r = n_in = 16 for both), non-square."""

    def __init__(self):
        super().__init__()
        self.linear_fc1 = nn.Linear(16, 40, bias=False)
        self.mid = nn.Linear(40, 16)
        self.linear_fc2 = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.linear_fc2(torch.tanh(self.mid(torch.tanh(self.linear_fc1(x)))))


def test_orthonormal_full_rank_projection_gives_exact_dense_sgd():
    torch.manual_seed(3)
    model = Funnel()
    ref = DenseRef(model)
    w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    lr = 0.1
    opt = make_logra(model, rank=16, algorithm="sgd", lr=lr, cache_projections=False,
                     native=NativeConfig(freeze=True))
    assert not model.mid.weight.requires_grad
    gen = torch.Generator().manual_seed(4)
    Q = {t.key: torch.linalg.qr(torch.randn(16, 16, generator=gen, dtype=F64))[0].float() for t in opt.targets}
    for q in Q.values():
        torch.testing.assert_close(q.double().T @ q.double(), torch.eye(16, dtype=F64), rtol=0, atol=1e-6)
    opt.sketches.projection_for = lambda target, update=None: Q[target.key]

    x, y = make_batch(5, (10,), 16, 8)
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    opt.step()
    grads = ref.grads(x, y, mean_loss)
    for t in opt.targets:
        name = f"{t.module_name}.weight"
        expected = w0[name] - lr * grads[name]
        assert (expected - w0[name]).abs().max() > 1e-3
        torch.testing.assert_close(t.weight.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.mid.weight.double(), w0["mid.weight"], rtol=0, atol=0)  # frozen native


# --------------------------------------------------------------------------- 5. clipping + native AdamW


@pytest.mark.parametrize("clip", [1e-2, 1e6], ids=["clipped", "not-clipped"])
def test_global_clipping_and_native_adamw(clip):
    model = make_mlp(0, bias=True, norm=True)
    ref = DenseRef(model)
    w0 = snapshot(model)
    lr = 0.1
    native_cfg = NativeConfig(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-4)
    opt = make_logra(model, algorithm="sgd", lr=lr, clip_grad=clip, native=native_cfg)
    target_names = {f"{t.module_name}.weight" for t in opt.targets}
    native_names = [n for n, _ in model.named_parameters() if n not in target_names]
    assert sorted(native_names) == ["linear_fc1.bias", "linear_fc2.bias", "norm.bias", "norm.weight"]

    x, y = make_batch(6, (8,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    update = opt.prepare()

    grads = ref.grads(x, y, mean_loss)
    sketches, norm2 = {}, 0.0
    for t in opt.targets:
        A = proj(opt, t, 0)
        S = grads[f"{t.module_name}.weight"] @ A.T
        sketches[t.key] = (S, A)
        norm2 += float((S @ A).pow(2).sum())
    norm2 += sum(float(grads[n].pow(2).sum()) for n in native_names)
    norm = math.sqrt(norm2)
    coef = clip / (norm + 1e-6) if norm > clip else 1.0
    assert update.grad_norm == pytest.approx(norm, rel=1e-5)
    assert update.clip_coef == pytest.approx(coef, rel=1e-5)
    if clip < 1:
        assert coef < 0.1
    else:
        assert update.clip_coef == 1.0

    opt.apply(update, 1.0)
    for t in opt.targets:
        S, A = sketches[t.key]
        name = f"{t.module_name}.weight"
        expected = w0[name].double() - lr * coef * S @ A
        assert (expected - w0[name].double()).abs().max() > 1e-4
        torch.testing.assert_close(t.weight.double(), expected, rtol=1e-5, atol=1e-7)

    def adamw_reference(scale):
        params = [w0[n].clone().requires_grad_(True) for n in native_names]
        # every native parameter here is 1-D (biases, norm): not decayed, as in Megatron
        ref_opt = torch.optim.AdamW(params, lr=native_cfg.lr, betas=(native_cfg.beta1, native_cfg.beta2),
                                    eps=native_cfg.eps, weight_decay=0.0)
        for p, n in zip(params, native_names):
            p.grad = (grads[n] * scale).float()
        ref_opt.step()
        return {n: p.detach() for n, p in zip(native_names, params)}

    expected_native = adamw_reference(coef)
    got = dict(model.named_parameters())
    for n in native_names:
        assert not torch.equal(got[n], w0[n]), n
        torch.testing.assert_close(got[n], expected_native[n], rtol=1e-5, atol=1e-7)
    if clip < 1:  # the native update is sensitive to the clip (eps is comparable to clipped grads)
        unclipped = adamw_reference(1.0)
        assert max(float((unclipped[n] - expected_native[n]).abs().max()) for n in native_names) > 1e-4


# --------------------------------------------------------------------------- 6. weight decay


def test_decoupled_weight_decay_in_optimizer_recipe():
    model = make_mlp(1)
    ref = DenseRef(model)
    w0 = snapshot(model)
    lr, wd, beta2, eps = 0.05, 0.4, 0.95, 1e-8
    opt = make_logra(model, algorithm="row_adam", lr=lr, weight_decay=wd, beta2=beta2, eps=eps)
    x, y = make_batch(7, (5,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    opt.step()
    grads = ref.grads(x, y, mean_loss)
    for t in opt.targets:
        name = f"{t.module_name}.weight"
        A = proj(opt, t, 0)
        D, _ = naive_row_adam(grads[name] @ A.T, torch.zeros(t.weight.shape[0], dtype=F64), 1, beta2, eps)
        expected = (1.0 - lr * wd) * w0[name].double() - lr * D @ A
        assert (lr * wd * w0[name]).abs().max() > 1e-3  # decay is far above the tolerance
        torch.testing.assert_close(t.weight.double(), expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 7. paper recipe


def test_paper_recipe_token_normalisation_norm_restoration_and_update_ratio():
    model = make_mlp(2, bias=True, norm=True)
    ref = DenseRef(model)
    w0 = snapshot(model)
    ratio, beta2, eps, alpha = 1e-3, 0.95, 1e-8, 0.7
    native_cfg = NativeConfig(lr=1e-2, eps=1e-3)
    opt = make_logra(model, recipe="paper", algorithm="row_adam", update_ratio=ratio, beta2=beta2, eps=eps,
                     lr=0.3, native=native_cfg)
    x, y = make_batch(8, (3, 5))
    num_tokens = 15
    opt.zero_grad()
    sum_loss(model, x, y).backward()
    with pytest.raises(ValueError, match="num_tokens"):
        opt.prepare()
    update = opt.prepare(num_tokens=num_tokens)
    assert not update.skipped and update.num_tokens == num_tokens

    grads = ref.grads(x, y, sum_loss)
    S, A, D_hat = {}, {}, {}
    for t in opt.targets:
        A[t.key] = proj(opt, t, 0)
        S[t.key] = grads[f"{t.module_name}.weight"] @ A[t.key].T / num_tokens
        D, _ = naive_row_adam(S[t.key], torch.zeros(t.weight.shape[0], dtype=F64), 1, beta2, eps)
        D_hat[t.key] = D * (S[t.key].norm() / D.norm())  # per-layer ‖D‖_F = ‖S/N‖_F
    w_norm = math.sqrt(sum(float(w0[f"{t.module_name}.weight"].double().pow(2).sum()) for t in opt.targets))
    d_norm = math.sqrt(sum(float((D_hat[t.key] @ A[t.key]).pow(2).sum()) for t in opt.targets))
    scale = ratio * w_norm / d_norm
    assert update.scale == pytest.approx(scale, rel=1e-5)
    for t in opt.targets:
        got = update.directions[t.key].double()
        assert float(got.norm()) / update.scale == pytest.approx(float(S[t.key].norm()), rel=1e-5)
        expected = scale * D_hat[t.key]  # fp32 sketch: entries small by cancellation get atol
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    got_ratio = math.sqrt(sum(float((update.directions[t.key].double() @ A[t.key]).pow(2).sum())
                              for t in opt.targets)) / w_norm
    assert got_ratio == pytest.approx(ratio, rel=1e-5)

    opt.apply(update, alpha)
    dw2 = 0.0
    for t in opt.targets:
        name = f"{t.module_name}.weight"
        got_delta = t.weight.double() - w0[name].double()
        expected_delta = -alpha * scale * D_hat[t.key] @ A[t.key]
        # W is fp32 (|W| < 1): rounding W1 costs <= 6e-8 absolute, vs |ΔW| ~ 1e-4
        torch.testing.assert_close(got_delta, expected_delta, rtol=1e-3, atol=2e-7)
        dw2 += float(got_delta.pow(2).sum())
    assert math.sqrt(dw2) / w_norm == pytest.approx(alpha * ratio, rel=1e-3)

    # native params: AdamW on gradients divided by the token count, the change scaled by α (logra.scale_native)
    native_names = [n for n, _ in model.named_parameters() if not n.endswith("fc1.weight") and not n.endswith("fc2.weight")]
    params = [w0[n].clone().requires_grad_(True) for n in native_names]
    ref_opt = torch.optim.AdamW(params, lr=native_cfg.lr, betas=(native_cfg.beta1, native_cfg.beta2),
                                eps=native_cfg.eps, weight_decay=native_cfg.weight_decay)
    for p, n in zip(params, native_names):
        p.grad = (grads[n] / num_tokens).float()
    ref_opt.step()
    got = dict(model.named_parameters())
    for p, n in zip(params, native_names):
        expected = w0[n].float() + alpha * (p.detach() - w0[n].float())
        torch.testing.assert_close(got[n], expected, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- 8. non-finite


@pytest.mark.parametrize("where", ["sketch-inf", "sketch-nan", "native-nan", "backward-inf"])
def test_nonfinite_step_is_skipped_and_changes_nothing(where):
    model = make_mlp(3, bias=True, norm=True)
    opt = make_logra(model, algorithm="row_adam", lr=0.01)
    x, y = make_batch(9, (6,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    assert not opt.step().skipped  # a good step first, so the moments are non-zero

    weights = snapshot(model)
    moments = {k: v.clone() for k, v in opt.row_moments.items()}
    assert all(bool((v > 0).all()) for v in moments.values())
    native_state = copy.deepcopy(opt.native.inner.state_dict())
    update_index, steps = opt.sketches.update, opt.num_steps

    x2, y2 = make_batch(10, (6,))
    opt.zero_grad()
    loss = mean_loss(model, x2, y2)
    if where == "backward-inf":
        loss = loss * float("inf")
    loss.backward()
    if where == "sketch-inf":
        opt.targets[0].sketch[1, 2] = float("inf")
    elif where == "sketch-nan":
        opt.sketches.flat[-1, 0] = float("nan")
    elif where == "native-nan":
        model.linear_fc1.bias.grad[0] = float("nan")
    update = opt.prepare()
    assert update.skipped and update.reason and "finite" in update.reason
    assert opt.num_skipped == 1
    opt.apply(update, 1.0)
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    for k, v in opt.row_moments.items():
        assert torch.equal(v, moments[k]), k
    assert opt.sketches.update == update_index and opt.num_steps == steps and opt.num_skipped == 1
    after = opt.native.inner.state_dict()["state"]
    for i, st in native_state["state"].items():
        assert float(after[i]["step"]) == float(st["step"])
        assert torch.equal(after[i]["exp_avg"], st["exp_avg"])

    # the next clean step goes through with the next step number
    opt.zero_grad()
    mean_loss(model, x2, y2).backward()
    update = opt.step()
    assert not update.skipped and update.step == 2 and opt.num_skipped == 1
    assert not torch.equal(model.linear_fc1.weight, weights["linear_fc1.weight"])


def test_dense_adamw_skips_nan_gradient():
    model = make_mlp(4, bias=True)
    opt = DenseAdamW(model, NativeConfig(lr=1e-2), GROUPS, clip_grad=1.0)
    x, y = make_batch(11, (4,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    assert not opt.step().skipped
    weights = snapshot(model)
    state = copy.deepcopy(opt.native.inner.state_dict())
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    model.linear_fc2.weight.grad[0, 0] = float("nan")
    update = opt.prepare()
    assert update.skipped and update.reason
    opt.apply(update)
    assert opt.num_skipped == 1 and opt.num_steps == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    after = opt.native.inner.state_dict()["state"]
    for i, st in state["state"].items():
        assert float(after[i]["step"]) == float(st["step"]) and torch.equal(after[i]["exp_avg_sq"], st["exp_avg_sq"])


# --------------------------------------------------------------------------- 10. state dict


def _run_steps(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        mean_loss(model, x.to(next(model.parameters()).dtype), y.to(next(model.parameters()).dtype)).backward()
        assert not opt.step().skipped


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@pytest.mark.parametrize("dtype,masters", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                           (torch.bfloat16, "none")])
def test_state_dict_resume_is_bitwise_identical(dtype, masters):
    cfg = dict(algorithm="row_adam", lr=0.02, clip_grad=0.5, masters=masters, rank=8)
    batches = [make_batch(20 + i, (6,)) for i in range(4)]

    model_a = make_mlp(0, dtype=dtype, bias=True, norm=True)
    opt_a = make_logra(model_a, **cfg)
    _run_steps(model_a, opt_a, batches)

    model_b = make_mlp(0, dtype=dtype, bias=True, norm=True)
    opt_b = make_logra(model_b, **cfg)
    _run_steps(model_b, opt_b, batches[:2])
    buf = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "optim": opt_b.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)

    for t in opt_b.targets:
        for tensor in _tensors(saved["optim"]):
            assert tuple(tensor.shape) != (8, t.n_in), "projections must never be checkpointed"
    assert set(saved["optim"]["row_moments"]) == {t.key for t in opt_b.targets}

    model_c = make_mlp(99, dtype=dtype, bias=True, norm=True)  # a different init, overwritten by the load
    opt_c = make_logra(model_c, **cfg)
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["optim"])
    assert opt_c.num_steps == 2 and opt_c.sketches.update == 2
    _run_steps(model_c, opt_c, batches[2:])

    for (n, pa), (_, pc) in zip(model_a.named_parameters(), model_c.named_parameters()):
        assert torch.equal(pa, pc), n
    for k, v in opt_a.row_moments.items():
        assert torch.equal(v, opt_c.row_moments[k]), k
    # and the resume matters: the resumed run differs from the saved point
    assert not torch.equal(model_c.linear_fc1.weight, saved["model"]["linear_fc1.weight"])


def test_load_state_dict_rejects_wrong_kind_and_missing_row_moments():
    model = make_mlp(0)
    opt = make_logra(model)
    dense_state = DenseAdamW(make_mlp(0), NativeConfig(), GROUPS).state_dict()
    with pytest.raises(ValueError, match="kind"):
        opt.load_state_dict(dense_state)
    state = opt.state_dict()
    del state["row_moments"]["linear_fc2"]
    with pytest.raises(ValueError, match="row moments.*linear_fc2"):
        opt.load_state_dict(state)
    state = opt.state_dict()
    state["row_moments"]["linear_fc1"] = torch.zeros(3)
    with pytest.raises(ValueError, match="linear_fc1"):
        opt.load_state_dict(state)
    with pytest.raises(ValueError, match="kind"):
        DenseAdamW(make_mlp(0), NativeConfig(), GROUPS).load_state_dict(opt.state_dict())


# --------------------------------------------------------------------------- 11. dense AdamW


def test_dense_adamw_bf16_matches_torch_adamw_on_fp32_masters():
    model = make_mlp(7, dtype=torch.bfloat16, bias=True, norm=True)
    ref_model = copy.deepcopy(model)  # plain bf16 autograd, no hooks
    cfg = NativeConfig(lr=1e-2, weight_decay=0.05, beta1=0.85, beta2=0.97, eps=1e-6)
    opt = DenseAdamW(model, cfg, GROUPS, clip_grad=0.0)
    masters = [p.detach().float().clone().requires_grad_(True) for p in ref_model.parameters()]
    # Megatron's groups: 1-D parameters (biases, norm weights) are not decayed
    ref_opt = torch.optim.AdamW([{"params": [m for m in masters if m.dim() > 1]},
                                 {"params": [m for m in masters if m.dim() == 1], "weight_decay": 0.0}],
                                lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    for step in range(3):
        x, y = make_batch(30 + step, (5,), dtype=torch.bfloat16)
        opt.zero_grad()
        mean_loss(model, x, y).backward()
        update = opt.step()
        assert not update.skipped
        ref_model.zero_grad(set_to_none=True)
        mean_loss(ref_model, x, y).backward()
        for m, p in zip(masters, ref_model.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters()):
                p.copy_(m)
        for (n, p), m, own in zip(model.named_parameters(), masters, opt.native.masters):
            assert p.dtype == torch.bfloat16 and own.dtype == torch.float32
            torch.testing.assert_close(own, m.detach(), rtol=1e-6, atol=1e-8)
            assert torch.equal(p, own.to(torch.bfloat16)), n
    initial = make_mlp(7, dtype=torch.bfloat16, bias=True, norm=True)
    for (n, p), p0 in zip(model.named_parameters(), initial.parameters()):
        assert not torch.equal(p, p0), n  # every parameter was trained

    opt.zero_grad()
    mean_loss(model, x, y).backward()
    update = opt.prepare()
    with pytest.raises(ValueError, match="alpha"):
        opt.apply(update, 0.5)


def test_logra_apply_rejects_nonfinite_alpha():
    model = make_mlp(0)
    opt = make_logra(model)
    x, y = make_batch(40, (3,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    w = model.linear_fc1.weight.clone()
    update = opt.prepare()
    with pytest.raises(ValueError, match="alpha"):
        opt.apply(update, float("nan"))
    assert torch.equal(model.linear_fc1.weight, w)


# --------------------------------------------------------------------------- 12. config validation


@pytest.mark.parametrize("factory,field", [
    (lambda: LograConfig(rank=0), "logra.rank"),
    (lambda: LograConfig(distribution="foo"), "logra.distribution"),
    (lambda: LograConfig(beta2=1.0), "logra.beta2"),
    (lambda: LograConfig(beta2=-0.1), "logra.beta2"),
    (lambda: LograConfig(recipe="x"), "logra.recipe"),
    (lambda: LograConfig(algorithm="x"), "logra.algorithm"),
    (lambda: LograConfig(masters="x"), "logra.masters"),
    (lambda: LograConfig(rounding="x"), "logra.rounding"),
    (lambda: LograConfig(clip_grad=-1), "logra.clip_grad"),
    (lambda: LograConfig(update_ratio=0), "logra.update_ratio"),
    (lambda: LograConfig(eps=0), "logra.eps"),
    (lambda: LograConfig(lr=-1e-3), "logra.lr"),
    (lambda: LograConfig(weight_decay=-0.1), "logra.weight_decay"),
    (lambda: LograConfig(targets=[]), "logra.targets"),
    (lambda: NativeConfig(beta1=1.0), "native.beta1"),
    (lambda: NativeConfig(beta2=1.5), "native.beta2"),
    (lambda: NativeConfig(eps=0.0), "native.eps"),
    (lambda: NativeConfig(lr=-1.0), "native.lr"),
    (lambda: OptimizerConfig(name="sgd"), "optimizer.name"),
])
def test_config_validation_names_the_field(factory, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        factory()


def test_config_defaults_are_valid_and_documented_values():
    cfg = OptimizerConfig()
    assert cfg.name == "logra"
    assert (cfg.logra.beta2, cfg.logra.eps, cfg.logra.update_ratio, cfg.logra.rank) == (0.95, 1e-8, 6e-5, 256)
    assert LograConfig(beta2=0.0, clip_grad=0.0).beta2 == 0.0  # boundary values that are allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_step_scale_shortens_the_parameter_change_only(dtype):
    """``NativeAdamW.step(scale)``: parameters move by ``scale`` × torch AdamW's change (from the
    fp32 master), while the moments advance exactly as torch AdamW's do."""
    from megatron_logra.optim.native import NativeAdamW
    from megatron_logra.parallel import ParallelGroups

    gen = torch.Generator().manual_seed(5)
    init = torch.randn(7, 3, generator=gen)
    grads = [torch.randn(7, 3, generator=gen) for _ in range(3)]
    ref = init.clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    p = torch.nn.Parameter(init.clone().to(dtype))
    opt = NativeAdamW([p], lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, groups=ParallelGroups())
    master = opt.masters[0]
    for g in grads:
        before = master.detach().clone()
        ref_before = ref.detach().clone()
        ref.grad = g.clone()
        ref_opt.step()
        # the reference for this step starts from our master (earlier scaled steps moved it elsewhere)
        with torch.no_grad():
            ref_state = ref_opt.state[ref]
        opt.zero_grad()
        if dtype == torch.float32:
            p.grad = g.clone()
        else:
            p.main_grad.copy_(g)
        opt.step(scale=0.25)
        state = opt.inner.state[master]
        torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=0, atol=0)
        # AdamW change from `before`: decoupled decay on `before`, moment ratio the same as the reference's
        lr, wd = 0.05, 0.1
        adam_dir = (ref_before * (1 - lr * wd) - ref.detach()) / lr  # m̂/(√v̂+ε) of the reference step
        expected = before + 0.25 * (before * (1 - lr * wd) - lr * adam_dir - before)
        torch.testing.assert_close(master, expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), master.to(dtype))

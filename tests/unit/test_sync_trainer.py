"""Trainer side of sketch-delta sync: ``build_delta`` + ``LograOptimizer.apply(..., factors=...)``.

A small megatron-named torch model (plain ``nn.Linear`` targets ``linear_qkv``/``linear_proj``/
``linear_fc1``/``linear_fc2`` and trained RMS-norm weights) is stepped three times; after each
step its weights, mapped to Hugging Face names here with explicit per-group loops, must be
bitwise equal to an engine copy that only ever received encoded deltas.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_logra.optim import LograConfig, LograOptimizer, NativeConfig
from megatron_logra.parallel import ParallelGroups
from megatron_logra.sync.apply import apply_delta_, off_grid_rows
from megatron_logra.sync.codec import AttentionDims, decode, encode
from megatron_logra.sync.trainer import build_delta, local_factors, merge_deltas

GROUPS = ParallelGroups()
H, G, D, HID, F = 4, 2, 4, 16, 24


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class _Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_qkv = nn.Linear(HID, (H + 2 * G) * D, bias=False)
        self.linear_proj = nn.Linear(H * D, HID, bias=False)

    def forward(self, x):
        qkv = self.linear_qkv(x)
        return self.linear_proj(torch.tanh(qkv[..., : H * D]) * torch.sigmoid(qkv[..., H * D : H * D + 1]))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = nn.Linear(HID, 2 * F, bias=False)
        self.linear_fc2 = nn.Linear(F, HID, bias=False)

    def forward(self, x):
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(torch.nn.functional.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = _Norm(HID)
        self.self_attention = _Attn()
        self.pre_mlp_layernorm = _Norm(HID)
        self.mlp = _MLP()

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(n)])
        self.final_layernorm = _Norm(HID)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class _Model(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.decoder = _Decoder(n)

    def forward(self, x):
        return self.decoder(x)


def _to_hf(model: _Model) -> dict[str, torch.Tensor]:
    """Megatron-named weights -> HF names; QKV rows de-interleaved group by group."""
    out = {"model.norm.weight": model.decoder.final_layernorm.weight.detach().clone()}
    per = H // G
    for i, layer in enumerate(model.decoder.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attention.linear_qkv.weight.detach()
        q, k, v = [], [], []
        for g in range(G):
            block = qkv[g * (per + 2) * D : (g + 1) * (per + 2) * D]
            q.append(block[: per * D])
            k.append(block[per * D : (per + 1) * D])
            v.append(block[(per + 1) * D :])
        out[p + "self_attn.q_proj.weight"] = torch.cat(q)
        out[p + "self_attn.k_proj.weight"] = torch.cat(k)
        out[p + "self_attn.v_proj.weight"] = torch.cat(v)
        out[p + "self_attn.o_proj.weight"] = layer.self_attention.linear_proj.weight.detach().clone()
        fc1 = layer.mlp.linear_fc1.weight.detach()
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1[:F].clone(), fc1[F:].clone()
        out[p + "mlp.down_proj.weight"] = layer.mlp.linear_fc2.weight.detach().clone()
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.detach().clone()
        out[p + "post_attention_layernorm.weight"] = layer.pre_mlp_layernorm.weight.detach().clone()
    return out


def _setup(weight_decay=0.0, freeze_native=False, seed=0):
    torch.manual_seed(seed)
    model = _Model()
    engine = _to_hf(model)
    cfg = LograConfig(rank=8, lr=3e-2, weight_decay=weight_decay, clip_grad=0.0, seed=7)
    opt = LograOptimizer(model, cfg, NativeConfig(lr=1e-2, freeze=freeze_native), GROUPS)
    return model, engine, opt


def _backward(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(3, 5, HID, generator=gen)
    model(x).pow(2).mean().backward()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_trainer_and_engine_stay_bitwise_equal_over_steps(weight_decay):
    model, engine, opt = _setup(weight_decay)
    start = _to_hf(model)
    version = 0
    for step in range(3):
        opt.zero_grad()
        _backward(model, step)
        update = opt.prepare()
        alpha = 0.7
        factors = local_factors(opt, update, alpha)
        opt.apply(update, alpha, factors=factors)
        delta = build_delta(opt, update, alpha, version, version + 1, GROUPS, model=model, dims=AttentionDims(H, G, D),
                            factors=factors)
        assert delta.update_index == step and delta.decay == pytest.approx(1 - 3e-2 * weight_decay)
        assert len(delta.dense) == 2 * 2 + 1  # two norms per layer + the final norm, HF names
        version = apply_delta_(engine, decode(encode(delta)), version)
        mapped = _to_hf(model)
        for name in mapped:
            assert torch.equal(engine[name], mapped[name]), f"step {step}: {name} drifted"
    for t in delta.targets:
        assert off_grid_rows(t.U_OR) == 0
        key = t.name
        D_ = update.directions[key]
        torch.testing.assert_close(t.U_OR.float(), (alpha * D_).bfloat16().float(), rtol=2**-7, atol=0)
    assert not torch.equal(engine["model.layers.1.mlp.down_proj.weight"], start["model.layers.1.mlp.down_proj.weight"])


def test_factors_apply_is_the_default_update_up_to_bf16_rounding():
    model_a, _, opt_a = _setup(freeze_native=True)
    model_b, _, opt_b = _setup(freeze_native=True)
    for model, opt, use in ((model_a, opt_a, True), (model_b, opt_b, False)):
        opt.zero_grad()
        _backward(model, 0)
        update = opt.prepare()
        opt.apply(update, 0.5, factors=local_factors(opt, update, 0.5) if use else None)
    wa, wb = model_a.decoder.layers[0].mlp.linear_fc1.weight, model_b.decoder.layers[0].mlp.linear_fc1.weight
    step = (wb - _setup(freeze_native=True)[0].decoder.layers[0].mlp.linear_fc1.weight).abs().max()
    assert step > 1e-3
    assert (wa - wb).abs().max() <= step * 2**-7  # the only difference: U rounded to bf16 (relative 2^-8 per entry)


def test_factors_are_checked_before_any_change():
    model, _, opt = _setup(freeze_native=True)
    _backward(model, 0)
    update = opt.prepare()
    factors = local_factors(opt, update, 1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = dict(factors)
    bad.pop(next(iter(bad)))
    with pytest.raises(ValueError, match="missing"):
        opt.apply(update, 1.0, factors=bad)
    bad = {k: v.float() for k, v in factors.items()}
    with pytest.raises(ValueError, match="expected bf16"):
        opt.apply(update, 1.0, factors=bad)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_build_delta_needs_names_for_trained_natives_and_merge_joins_stages():
    model, _, opt = _setup()
    _backward(model, 0)
    update = opt.prepare()
    with pytest.raises(ValueError, match="need model="):
        build_delta(opt, update, 1.0, 0, 1, GROUPS, dims=AttentionDims(H, G, D))
    with pytest.raises(ValueError, match="need attention dims"):
        build_delta(opt, update, 1.0, 0, 1, GROUPS, model=model)  # a plain module has no .config


def test_merge_deltas_joins_stage_parts():
    model, _, opt = _setup(freeze_native=True)
    _backward(model, 0)
    update = opt.prepare()
    whole = build_delta(opt, update, 1.0, 0, 1, GROUPS, dims=AttentionDims(H, G, D))
    first = type(whole)(**{**whole.__dict__, "targets": whole.targets[:4]})
    second = type(whole)(**{**whole.__dict__, "targets": whole.targets[4:]})
    merged = merge_deltas([first, second])
    assert [t.name for t in merged.targets] == [t.name for t in whole.targets]
    assert merged.header() == whole.header()  # every header field survives, the noise-keying step included
    with pytest.raises(ValueError, match="appears in two parts"):
        merge_deltas([first, first])
    with pytest.raises(ValueError):
        merge_deltas([first, type(whole)(**{**second.__dict__, "step": whole.step + 1})])


def test_fp32_masters_mirror_the_engine_and_reanchor():
    """bf16 targets with fp32 masters: the compute weights replay the engine's bf16 merges (bitwise
    equal to an engine fed only deltas) while the masters keep the fp32 step; ``master_drift`` is
    their separation and ``reanchor`` copies the masters back."""
    torch.manual_seed(0)
    model = _Model().to(torch.bfloat16)
    engine = _to_hf(model)
    cfg = LograConfig(rank=8, lr=3e-2, clip_grad=0.0, seed=7, masters="fp32")
    opt = LograOptimizer(model, cfg, NativeConfig(freeze=True), GROUPS)
    assert opt.masters and opt.master_drift() == 0.0
    version = 0
    for step in range(3):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(100 + step)
        model(torch.randn(3, 5, HID, generator=gen).bfloat16()).float().pow(2).mean().backward()
        update = opt.prepare()
        factors = local_factors(opt, update, 1.0)
        masters_before = {k: m.clone() for k, m in opt.masters.items()}
        opt.apply(update, 1.0, factors=factors)
        delta = build_delta(opt, update, 1.0, version, version + 1, GROUPS, model=model, dims=AttentionDims(H, G, D),
                            factors=factors)
        version = apply_delta_(engine, decode(encode(delta)), version)
        mapped = _to_hf(model)
        for name in mapped:
            assert torch.equal(engine[name], mapped[name]), f"step {step}: {name} differs from the engine"
        for t in opt.targets:  # the master took the fp32 step: m - D·A (α = 1, not the bf16 U) up to fp32 rounding
            A = opt.sketches.projection_for(t, update.update_index).double()
            expected = masters_before[t.key].double() - update.directions[t.key].double() @ A
            torch.testing.assert_close(opt.masters[t.key].double(), expected, rtol=1e-6, atol=1e-7)
    num = sum((t.weight.double() - opt.masters[t.key].bfloat16().double()).pow(2).sum() for t in opt.targets)
    den = sum(opt.masters[t.key].bfloat16().double().pow(2).sum() for t in opt.targets)
    drift = opt.master_drift()
    assert drift > 0 and drift == pytest.approx((num / den).sqrt().item(), rel=1e-9)
    opt.reanchor()
    assert opt.master_drift() == 0.0
    for t in opt.targets:
        assert torch.equal(t.weight, opt.masters[t.key].bfloat16())

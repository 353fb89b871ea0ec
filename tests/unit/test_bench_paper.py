"""``megatron-logra bench paper``: the cosine measurement, the theory it is compared with, the
GaLore/APOLLO optimizer factories and the config's validation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.bench.cosine_fig import cosine, reconstruction_cosines, theory_cosine
from megatron_logra.bench.peers import PeerOptimizer, PeerSettings, peer_missing, target_weights
from megatron_logra.optim import NativeConfig
from megatron_logra.parallel import ParallelGroups
from megatron_logra.sketch import projection

GROUPS = ParallelGroups()  # one rank, no collectives


# ------------------------------------------------------------------------------------ cosine
def test_cosine_matches_definition_and_edge_cases():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    a64, b64 = a.double(), b.double()  # the reference in float64: a float32 one misses rel 1e-6 near zero
    expected = float((a64 * b64).sum() / (a64.norm() * b64.norm()))
    assert cosine(a, b) == pytest.approx(expected, rel=1e-6)
    assert cosine(a, 3 * a) == pytest.approx(1.0, abs=1e-12)
    assert cosine(a, -a) == pytest.approx(-1.0, abs=1e-12)


def test_reconstruction_cosine_against_autograd_on_a_tiny_linear():
    """Dense gradient of a linear layer by autograd vs S·A with S = Hᵀ(X·Aᵀ) formed from the
    layer's input and output gradient (the capture formula), computed independently."""
    gen = torch.Generator().manual_seed(1)
    n_in, n_out, tokens, rank = 48, 16, 64, 8
    layer = nn.Linear(n_in, n_out, bias=False)
    grads, sketches, projs = [], [], []
    for step in range(3):
        x = torch.randn(tokens, n_in, generator=gen)
        target = torch.randn(tokens, n_out, generator=gen)
        y = layer(x)
        h = torch.autograd.grad(((y - target) ** 2).sum(), y, retain_graph=True)[0]
        layer.zero_grad()
        ((y - target) ** 2).sum().backward()
        a = projection(7, "decoder.layers.0.mlp.linear_fc1", step, rank, n_in)
        grads.append(layer.weight.grad.clone())
        sketches.append(h.t() @ (x @ a.t()))
        projs.append(a)
    single, accumulated = reconstruction_cosines(grads, sketches, projs)
    # the same numbers straight from the definitions
    recon = [g @ a.t() @ a for g, a in zip(grads, projs)]
    exp_single = sum(float((g * r).sum() / (g.norm() * r.norm())) for g, r in zip(grads, recon)) / 3
    g_sum, r_sum = sum(grads), sum(recon)
    exp_acc = float((g_sum * r_sum).sum() / (g_sum.norm() * r_sum.norm()))
    assert single == pytest.approx(exp_single, rel=1e-4)
    assert accumulated == pytest.approx(exp_acc, rel=1e-4)
    assert 0.0 < single < 1.0
    # a full-rank orthonormal "projection" reconstructs exactly: the measurement can reach 1
    q = torch.linalg.qr(torch.randn(n_in, n_in, generator=gen))[0].t()
    s_full = [g @ q.t() for g in grads]
    assert reconstruction_cosines(grads, s_full, [q] * 3)[0] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_theory_matches_monte_carlo_mean(distribution):
    """sqrt(r/(r+n_in)) is the Monte-Carlo mean of cos(G, G·AᵀA) on a random full-rank G."""
    gen = torch.Generator().manual_seed(2)
    rank, n_in, n_out = 16, 96, 64
    g = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64)
    values = []
    for update in range(40):
        a = projection(3, "decoder.layers.1.self_attention.linear_qkv", update, rank, n_in,
                       distribution=distribution).double()
        values.append(cosine(g, g @ a.t() @ a))
    mean = sum(values) / len(values)
    assert mean == pytest.approx(theory_cosine(rank, n_in), rel=0.03)
    assert theory_cosine(rank, n_in) == pytest.approx(math.sqrt(16 / 112))
    # and it is not a tautology: another rank gives a clearly different mean
    assert abs(mean - theory_cosine(2 * rank, n_in)) > 0.05


# ------------------------------------------------------------------------------------ peers
class _Toy(nn.Module):
    def __init__(self, n_out: int = 12, n_in: int = 8) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(n_in, n_out, bias=True)
        self.norm = nn.LayerNorm(n_in)


def _one_step(peer: str, grad: torch.Tensor, rank: int = 3, lr: float = 1e-2):
    torch.manual_seed(0)
    model = _Toy(*grad.shape)
    w0 = model.linear_fc1.weight.detach().clone()
    b0 = model.linear_fc1.bias.detach().clone()
    opt = PeerOptimizer(model, NativeConfig(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8), GROUPS, peer=peer,
                        settings=PeerSettings(rank=rank, update_proj_gap=10), targets=["linear_fc1"], clip_grad=0.0)
    model.linear_fc1.weight.grad = grad.clone()
    model.linear_fc1.bias.grad = torch.ones_like(b0)
    model.norm.weight.grad = torch.ones_like(model.norm.weight)
    model.norm.bias.grad = torch.ones_like(model.norm.bias)
    update = opt.prepare()
    opt.apply(update)
    return model, opt, model.linear_fc1.weight.detach() - w0, model.linear_fc1.bias.detach() - b0


def _skip_if_missing(peer: str) -> None:
    reason = peer_missing(peer)
    if reason:
        pytest.skip(reason)


def test_galore_factory_step_matches_documented_update():
    """GaLore (m >= n: right projection on the top-r right singular vectors of G, Adam in the
    projected space, projected back): ΔW = −lr·scale·(R / (|R| + ε'))·P at step 1, R = G·Pᵀ."""
    _skip_if_missing("galore")
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(12, 8, generator=gen)
    lr, rank = 1e-2, 3
    _, opt, dw, db = _one_step("galore", g, rank, lr)
    p = torch.linalg.svd(g, full_matrices=False)[2][:rank]
    r = g @ p.t()
    expected = -lr * (r / (r.abs() + 1e-8 / math.sqrt(1 - 0.95))) @ p
    torch.testing.assert_close(dw, expected, rtol=1e-4, atol=1e-7)
    assert dw.norm() > 0
    # the bias is not a target: plain AdamW, first step = −lr·sign(grad)
    torch.testing.assert_close(db, torch.full_like(db, -lr), rtol=1e-4, atol=1e-7)
    assert opt.num_low_rank == g.numel()


def test_apollo_factory_step_is_channelwise_scaled_gradient():
    """APOLLO: the raw gradient scaled per channel by ‖Adam(R)_i‖ / ‖R_i‖ with R = G·Pᵀ from its
    random projector (step 1: Adam(R) = R / (|R| + ε'))."""
    _skip_if_missing("apollo")
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(12, 8, generator=gen)
    lr = 1e-2
    _, opt, dw, _ = _one_step("apollo", g, 3, lr)
    p = next(s["projector"].ortho_matrix for s in opt.native.inner.state.values() if "projector" in s)
    assert p.shape == (3, 8)
    r = g @ p.t()
    n = r / (r.abs() + 1e-8 / math.sqrt(1 - 0.95))
    scale = n.norm(dim=1) / (r.norm(dim=1) + 1e-8)
    torch.testing.assert_close(dw, -lr * scale.unsqueeze(1) * g, rtol=1e-4, atol=1e-7)
    assert dw.abs().max() > 0


def test_peer_rejects_unknown_peer_and_missing_targets():
    with pytest.raises(ValueError, match="unknown peer"):
        peer_missing("sophia")
    with pytest.raises(ValueError, match="no module of the model matches"):
        target_weights(_Toy(), ["linear_qkv"])
    assert [tuple(w.shape) for w in target_weights(_Toy(), ["up_proj"])] == [(12, 8)]  # HF alias of fc1


def test_peer_checkpoint_state_has_only_parameter_shaped_slots():
    _skip_if_missing("galore")
    model, opt, _, _ = _one_step("galore", torch.randn(12, 8))
    scalars, slots = opt.sharded_state()
    assert scalars["kind"] == "galore" and scalars["num_steps"] == 1
    assert all(tuple(s.tensor.shape) == tuple(s.param.shape) for s in slots)
    assert all(s.param is not model.linear_fc1.weight for s in slots)  # its moments are rank-r, left out
    assert any(s.param is model.linear_fc1.bias for s in slots)
    with pytest.raises(NotImplementedError):
        opt.load_sharded_state(scalars, slots)


# ------------------------------------------------------------------------------------ config
def test_presets_are_valid_and_quick_is_smaller():
    quick, full = PaperBenchConfig.preset(True), PaperBenchConfig.preset(False)
    assert quick.quick and not full.quick
    assert quick.rl_steps < full.rl_steps and len(quick.seeds) < len(full.seeds)
    assert max(h for h, _ in quick.memory_sizes) < max(h for h, _ in full.memory_sizes)


@pytest.mark.parametrize("field, value", [
    ("optimizers", ["logra", "sgd"]), ("optimizers", []), ("kl_modes", ["kl2"]), ("seeds", []),
    ("seeds", [0]), ("ranks", [256]), ("rl_steps", 0), ("eval_interval", 100), ("k3_coef", 0.0),
    ("memory_sizes", [(100, 1)]), ("memory_sizes", []), ("cosine_rank", 0), ("figures", ["fig9"]),
    ("theory_tolerance", -1.0), ("out_dir", ""), ("threads", True), ("planner_presets", []),
])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PaperBenchConfig(**{field: value})


def test_cli_parser_builds_config_and_rejects_bad_values():
    from megatron_logra.bench.cli import build_parser, config_from_args

    ns = build_parser().parse_args(["paper", "--quick", "--optimizers", "logra", "adam", "--rl-steps", "3"])
    cfg = config_from_args(ns)
    assert cfg.quick and cfg.optimizers == ["logra", "adam"] and cfg.rl_steps == 3 and cfg.eval_interval == 3
    with pytest.raises(ValueError, match="seeds"):
        config_from_args(build_parser().parse_args(["paper", "--seeds", "0"]))


# ------------------------------------------------------------------------------------ missing peers
def test_missing_peer_is_reported_and_skipped(monkeypatch):
    import sys

    from megatron_logra.bench.accuracy_fig import RunCache, RunResult
    from megatron_logra.bench.memory_fig import MemoryRow
    from megatron_logra.bench.report import render_report

    monkeypatch.setitem(sys.modules, "apollo_torch", None)  # `import apollo_torch` now raises ImportError
    reason = peer_missing("apollo")
    assert reason and "apollo-torch" in reason
    with pytest.raises(RuntimeError, match="unavailable"):
        PeerOptimizer(_Toy(), NativeConfig(), GROUPS, peer="apollo", settings=PeerSettings(rank=2),
                      targets=["linear_fc1"])
    cfg = PaperBenchConfig.preset(True, optimizers=["logra", "apollo"])
    skipped = RunCache(cfg).optimizer("apollo", 1)  # no run is started for a missing peer
    assert skipped.skipped == reason
    logra = RunResult(label="logra", seed=1, eval_before=0.1, eval_after=0.5, curve=[(0, 0.1), (5, 0.5)])
    text = render_report(cfg, timings={"total": 1.0}, missing={"apollo": reason},
                         memory=[MemoryRow(64, 1, "logra", params=10, peak_bytes=2, avg_bytes=1),
                                 MemoryRow(64, 1, "apollo", skipped=reason)],
                         planned=[], by_optimizer={"logra": [logra], "apollo": [skipped]}, by_rank={},
                         cosines=None, kl_rows=[], images={})
    assert "**Skipped peers**: apollo" in text and "| APOLLO | skipped |" in text

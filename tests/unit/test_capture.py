"""Tests of sketch capture (``install_sketches``) on plain modules and on a megatron-core GPT.

Reference: a deep copy of the model trained densely. For a target ``Y = X Wᵀ`` the sketch
must equal ``G Aᵀ`` with ``G = Hᵀ X`` the dense weight gradient and ``A`` the projection
regenerated independently from ``(seed, expected canonical name, update)``.

Tolerance: both sides are fp32 evaluations of the same exact product ``Hᵀ X Aᵀ`` (same
``H`` and ``X``: forward and input gradients are bitwise those of dense training, which is
asserted), only associated differently. The standard rounding-error bound of a dot product of
length ``K`` gives ``|fl(·) - exact| <= γ_K |H|ᵀ|X||A|ᵀ`` with ``γ_K = K u / (1 - K u)``,
``u = 2⁻²⁴`` and ``K = tokens + n_in + micro-batches`` (inner dimensions of both products plus
the accumulation). Hence ``|S - G Aᵀ| <= 2 γ_K |H|ᵀ|X||A|ᵀ`` elementwise, computed from ``X``
and ``H`` recorded in the dense model (``G Aᵀ`` itself is evaluated in float64).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_logra.sketch.capture import install_sketches
from megatron_logra.sketch.random_projection import projection

U32 = 2.0**-24


# --------------------------------------------------------------------------- helpers


class Recorder:
    """Records (X, H) of target modules of a dense model in grad-enabled forwards."""

    def __init__(self, model: nn.Module, module_names):
        self.xs: dict[str, list] = {n: [] for n in module_names}
        self.hs: dict[str, dict] = {n: {} for n in module_names}
        self.handles = []
        for n in module_names:
            self.handles.append(model.get_submodule(n).register_forward_hook(self._hook(n)))

    def _hook(self, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not (torch.is_grad_enabled() and out.requires_grad):
                return
            idx = len(self.xs[name])
            x = args[0]
            self.xs[name].append(x.detach().reshape(-1, x.shape[-1]).clone())

            def grad_hook(g, idx=idx):
                self.hs[name][idx] = g.detach().reshape(-1, g.shape[-1]).clone()

            out.register_hook(grad_hook)

        return hook

    def bound(self, name: str, proj: torch.Tensor) -> torch.Tensor:
        xs = self.xs[name]
        hs = [self.hs[name][i] for i in range(len(xs))]
        x = torch.cat(xs).double().abs()
        h = torch.cat(hs).double().abs()
        k = x.shape[0] + x.shape[1] + len(xs)
        gamma = k * U32 / (1 - k * U32)
        return 2 * gamma * (h.T @ x @ proj.double().abs().T)


def assert_sketch_matches(sketch, dense_grad, proj, bound):
    ref = dense_grad.double() @ proj.double().T
    err = (sketch.double() - ref).abs()
    assert sketch.shape == ref.shape
    # the bound is informative: far below the sketch's own magnitude
    assert float(bound.max()) < 1e-3 * float(ref.abs().max())
    assert bool((err <= bound).all()), float((err - bound).max())


class Block(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.linear_fc1 = nn.Linear(d, f)
        self.linear_fc2 = nn.Linear(f, d)

    def forward(self, x):
        return x + self.linear_fc2(torch.tanh(self.linear_fc1(self.norm(x))))


class MLPNet(nn.Module):
    def __init__(self, d=24, f=40, n_layers=2, out=7, ckpt=None):
        super().__init__()
        self.layers = nn.ModuleList(Block(d, f) for _ in range(n_layers))
        self.head = nn.Linear(d, out)
        self.ckpt = ckpt

    def forward(self, x):
        for block in self.layers:
            if self.ckpt is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(x)


MLP_TARGETS = {  # module name -> expected canonical name
    "layers.0.linear_fc1": "model.layers.0.mlp.gate_up_proj",
    "layers.0.linear_fc2": "model.layers.0.mlp.down_proj",
    "layers.1.linear_fc1": "model.layers.1.mlp.gate_up_proj",
    "layers.1.linear_fc2": "model.layers.1.mlp.down_proj",
}
RANK, SEED = 6, 17


def make_mlp(ckpt=None, seed=0) -> MLPNet:
    torch.manual_seed(seed)
    return MLPNet(ckpt=ckpt)


def micro_batches(n=3, b=2, s=5, d=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, d, generator=gen) for _ in range(n)]


def run(model, batches, input_grad=True):
    """Forward/backward every micro-batch (gradients accumulate); returns input grads and losses."""
    grads, losses = [], []
    for i, x in enumerate(batches):
        x = x.clone().requires_grad_(input_grad)
        out = model(x)
        loss = (out * torch.linspace(-1, 1, out.shape[-1])).pow(2).sum() / (i + 1)
        loss.backward()
        grads.append(x.grad)
        losses.append(loss.detach())
    return grads, losses


# --------------------------------------------------------------------------- plain modules


@pytest.mark.parametrize("cache", [True, False])
def test_mlp_sketch_equals_dense_gradient_times_projection(cache):
    dense = make_mlp()
    model = copy.deepcopy(dense)
    ss = install_sketches(model, targets=("linear_fc1", "linear_fc2"), rank=RANK, seed=SEED, cache_projections=cache)
    assert {t.module_name: t.name for t in ss.targets} == MLP_TARGETS
    rec = Recorder(dense, MLP_TARGETS)
    batches = micro_batches()
    g_dense, l_dense = run(dense, batches)
    g_sk, l_sk = run(model, batches)

    for a, b in zip(l_dense, l_sk):
        assert torch.equal(a, b)
    for a, b in zip(g_dense, g_sk):
        assert torch.equal(a, b)  # input gradients are those of dense training, bitwise
    for t in ss.targets:
        proj = projection(SEED, MLP_TARGETS[t.module_name], 0, RANK, t.n_in)
        assert torch.equal(ss.projection_for(t), proj)
        dense_w = dense.get_submodule(t.module_name).weight
        assert_sketch_matches(t.sketch, dense_w.grad, proj, rec.bound(t.module_name, proj))
        assert t.weight.requires_grad is False and t.weight.grad is None
    # the flat buffer holds exactly the target row blocks
    assert ss.flat.shape == (sum(t.weight.shape[0] for t in ss.targets), RANK)
    # non-target parameters (biases, norms, head) train as before, bitwise
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        if name.removesuffix(".weight") in MLP_TARGETS:
            continue
        assert p.requires_grad and p.grad is not None, name
        assert torch.equal(p.grad, dense_params[name].grad), name


class HFLayer(nn.Module):
    def __init__(self, d=16, f=20):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d, bias=False)
        self.self_attn.k_proj = nn.Linear(d, d // 2, bias=False)
        self.self_attn.v_proj = nn.Linear(d, d // 2, bias=False)
        self.self_attn.o_proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, f, bias=False)
        self.mlp.up_proj = nn.Linear(d, f, bias=False)
        self.mlp.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        a = self.self_attn
        mix = torch.tanh(a.q_proj(h)) * torch.cat([a.k_proj(h), a.v_proj(h)], dim=-1)
        x = x + a.o_proj(mix)
        m = self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


def test_hf_aliases_match_default_targets_and_share_projection_per_input():
    torch.manual_seed(3)
    dense = nn.Module()
    dense.model = nn.Module()
    dense.model.layers = nn.ModuleList([HFLayer(), HFLayer()])
    model = copy.deepcopy(dense)
    ss = install_sketches(model, rank=4, seed=5)  # default targets: megatron kinds with HF aliases
    kind = {"q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj", "v_proj": "self_attn.qkv_proj",
            "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up_proj", "up_proj": "mlp.gate_up_proj",
            "down_proj": "mlp.down_proj"}
    expected = {
        f"model.layers.{i}.{grp}.{leaf}": f"model.layers.{i}.{kind[leaf]}"
        for i in range(2)
        for grp, leaves in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for leaf in leaves
    }
    assert {t.module_name: t.name for t in ss.targets} == expected
    assert len({t.key for t in ss.targets}) == len(ss.targets)  # state keys stay unique
    rec = Recorder(dense, expected)
    batches = micro_batches(n=2, d=16, seed=4)

    def fwd(m, x):
        for layer in m.model.layers:
            x = layer(x)
        return x

    for x in batches:
        fwd(dense, x).square().sum().backward()
        fwd(model, x).square().sum().backward()
    for t in ss.targets:
        proj = projection(5, expected[t.module_name], 0, 4, t.n_in)
        assert torch.equal(ss.projection_for(t), proj)
        dw = dense.get_submodule(t.module_name).weight.grad
        assert_sketch_matches(t.sketch, dw, proj, rec.bound(t.module_name, proj))


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_activation_checkpoint_does_not_double_count(mode):
    batches = micro_batches()
    plain = make_mlp()
    ckpt = make_mlp(ckpt=mode)
    dense = make_mlp()
    ss_plain = install_sketches(plain, targets=("linear_fc1", "linear_fc2"), rank=RANK, seed=SEED)
    ss_ckpt = install_sketches(ckpt, targets=("linear_fc1", "linear_fc2"), rank=RANK, seed=SEED)
    rec = Recorder(dense, MLP_TARGETS)
    run(dense, batches)
    g_plain, _ = run(plain, batches)
    g_ckpt, _ = run(ckpt, batches)
    for a, b in zip(g_plain, g_ckpt):
        assert torch.equal(a, b)
    assert float(ss_plain.flat.abs().max()) > 0
    assert torch.equal(ss_ckpt.flat, ss_plain.flat)  # same bits: added exactly once per micro-batch
    for t in ss_ckpt.targets:
        proj = projection(SEED, t.name, 0, RANK, t.n_in)
        dw = dense.get_submodule(t.module_name).weight.grad
        assert_sketch_matches(t.sketch, dw, proj, rec.bound(t.module_name, proj))


def test_everything_frozen_still_fills_sketches():
    dense = make_mlp()
    model = copy.deepcopy(dense)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, p in dense.named_parameters():  # reference: only target weights train
        p.requires_grad_(name.removesuffix(".weight") in MLP_TARGETS)
    ss = install_sketches(model, targets=("linear_fc1", "linear_fc2"), rank=RANK, seed=SEED)
    rec = Recorder(dense, MLP_TARGETS)
    batches = micro_batches(n=2)
    for x in batches:
        assert not x.requires_grad
        out = model(x)
        assert out.requires_grad  # capture makes backward reachable
        out.square().sum().backward()
        dense(x).square().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    for t in ss.targets:
        proj = projection(SEED, t.name, 0, RANK, t.n_in)
        dw = dense.get_submodule(t.module_name).weight.grad
        assert_sketch_matches(t.sketch, dw, proj, rec.bound(t.module_name, proj))


def test_saved_projection_is_released_after_backward():
    model = make_mlp()
    ss = install_sketches(model, targets=("linear_fc1", "linear_fc2"), rank=RANK, seed=SEED)
    refs = []

    def pack(t):
        if t.dim() >= 1 and t.shape[-1] == RANK:  # only P = X Aᵀ has last dim r in this model
            refs.append(weakref.ref(t))
        return t

    x = micro_batches(n=1)[0].requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().sum()
    gc.collect()
    assert len(refs) == len(ss.targets)  # one P saved per target
    assert all(r() is not None for r in refs)  # alive while the graph may still backward
    loss.backward()
    gc.collect()
    # freed by autograd itself: the graph root is still referenced here
    assert all(r() is None for r in refs)
    assert float(ss.flat.abs().max()) > 0
    with pytest.raises(RuntimeError):
        loss.backward()


def test_paused_and_no_grad_capture_nothing():
    model = make_mlp()
    ss = install_sketches(model, targets=("linear_fc1", "linear_fc2"), rank=RANK, seed=SEED)
    x = micro_batches(n=1)[0]
    with ss.paused():
        assert ss.capture_enabled is False
        out = model(x)
    assert ss.capture_enabled is True
    out.square().sum().backward()  # backward outside the context: still nothing was captured
    assert torch.count_nonzero(ss.flat) == 0
    assert model.head.weight.grad is not None  # the backward did run
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    assert torch.count_nonzero(ss.flat) == 0
    # capture resumes afterwards (so the checks above could fail)
    model(x).square().sum().backward()
    assert torch.count_nonzero(ss.flat) > 0


@pytest.mark.parametrize("refresh", [True, False])
def test_refresh_redraws_projection_after_advance(refresh):
    dense = make_mlp()
    model = copy.deepcopy(dense)
    ss = install_sketches(model, targets=("linear_fc1", "linear_fc2"), rank=RANK, seed=SEED, refresh=refresh)
    t0 = ss.targets[0]
    a0 = projection(SEED, t0.name, 0, RANK, t0.n_in)
    assert ss.update == 0 and torch.equal(ss.projection_for(t0), a0)
    x = micro_batches(n=1)[0]
    model(x).square().sum().backward()  # fills the cache (if any) with update 0
    ss.advance()
    ss.zero_()
    assert torch.count_nonzero(ss.flat) == 0
    expected_update = 1 if refresh else 0
    assert ss.update == expected_update
    a1 = projection(SEED, t0.name, expected_update, RANK, t0.n_in)
    assert torch.equal(ss.projection_for(t0), a1)
    assert torch.equal(a0, a1) is (not refresh)
    # capture after advance() uses the new A
    rec = Recorder(dense, MLP_TARGETS)
    model(x).square().sum().backward()
    dense(x).square().sum().backward()
    for t in ss.targets:
        proj = projection(SEED, t.name, expected_update, RANK, t.n_in)
        dw = dense.get_submodule(t.module_name).weight.grad
        assert_sketch_matches(t.sketch, dw, proj, rec.bound(t.module_name, proj))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_qkv = nn.Conv1d(4, 4, 1)
        self.linear_fc1 = nn.Linear(4, 4)


@pytest.mark.parametrize(
    "factory,kwargs",
    [
        (make_mlp, dict(targets=("linear_fc1", "linear_nope"), rank=4)),
        (make_mlp, dict(targets=("q_proj",), rank=4)),  # a known alias absent from this model
        (make_mlp, dict(targets=(), rank=4)),
        (make_mlp, dict(targets=("linear_fc1", "linear_fc2"), rank=25)),  # fc1 has n_in = 24
        (make_mlp, dict(targets=("linear_fc1",), rank=0)),
        (make_mlp, dict(targets=("linear_fc1",), rank=-2)),
        (make_mlp, dict(targets=("linear_fc1",), rank=4, distribution="normal")),
        (ConvNet, dict(targets=("linear_qkv", "linear_fc1"), rank=2)),
    ],
)
def test_bad_configs_raise_and_leave_model_untouched(factory, kwargs):
    model = factory()
    with pytest.raises(ValueError):
        install_sketches(model, **kwargs)
    assert all(p.requires_grad for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())


# --------------------------------------------------------------------------- megatron-core GPT

GPT_LEAVES = {
    "self_attention.linear_qkv": "self_attn.qkv_proj",
    "self_attention.linear_proj": "self_attn.o_proj",
    "mlp.linear_fc1": "mlp.gate_up_proj",
    "mlp.linear_fc2": "mlp.down_proj",
}
GPT_LEAVES_KINDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
GPT_TARGETS = {f"decoder.layers.{i}.{k}": f"model.layers.{i}.{v}" for i in range(2) for k, v in GPT_LEAVES.items()}


@pytest.fixture(scope="module")
def groups():
    pytest.importorskip("megatron.core")
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    g = initialize_parallel(ParallelConfig())
    yield g
    destroy_parallel()


def gpt_batches(n=2, b=2, s=16, vocab=64, seed=7):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(s)[None].expand(b, s)
    return [(torch.randint(0, vocab, (b, s), generator=gen), torch.randint(0, vocab, (b, s), generator=gen), pos)
            for _ in range(n)]


def gpt_step(model, batches):
    losses = []
    for tok, lab, pos in batches:
        loss_per_token = model(tok, pos, None, labels=lab)
        assert loss_per_token.shape == tok.shape
        loss_per_token.sum().backward()
        losses.append(loss_per_token.detach())
    return losses


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_megatron_gpt_sketches_equal_dense(groups, recompute):
    from megatron_logra.models.gpt import ModelConfig, build_gpt

    cfg = ModelConfig(recompute=recompute)
    dense = build_gpt(cfg, groups)
    model = build_gpt(cfg, groups)
    for (n, p), (_, q) in zip(dense.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n
    # the default targets and the output layer, whose logits megatron's cross entropy modifies in place
    targets = {**GPT_TARGETS, "output_layer": "output_layer"}
    ss = install_sketches(model, targets=(*GPT_LEAVES_KINDS, "output_layer"), rank=8, seed=1)
    assert {t.module_name: t.name for t in ss.targets} == targets
    rec = Recorder(dense, targets)
    batches = gpt_batches()
    l_dense = gpt_step(dense, batches)
    l_sk = gpt_step(model, batches)
    for a, b in zip(l_dense, l_sk):
        assert torch.equal(a, b)
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        if name.removesuffix(".weight") in targets:
            assert p.requires_grad is False and p.grad is None, name
            assert getattr(p, "main_grad", None) is None, name
        else:
            # embedding, norms: unchanged dense training (same H everywhere)
            assert p.grad is not None and torch.equal(p.grad, dense_params[name].grad), name
    for t in ss.targets:
        proj = projection(1, targets[t.module_name], 0, 8, t.n_in)
        assert torch.equal(ss.projection_for(t), proj)
        dw = dense.get_submodule(t.module_name).weight.grad
        assert_sketch_matches(t.sketch, dw, proj, rec.bound(t.module_name, proj))


def test_tied_output_layer_target_is_refused(groups):
    # tied embeddings: megatron's output_layer has no weight of its own (None at PP=1)
    from megatron_logra.models.gpt import ModelConfig, build_gpt

    model = build_gpt(ModelConfig(untie_embeddings_and_output_weights=False), groups)
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    with pytest.raises(ValueError, match=r"target 'output_layer' matches output_layer, whose weight is the word "
                                         r"embeddings.*set model.untie_embeddings_and_output_weights=true or drop "
                                         r"'output_layer' from the targets"):
        install_sketches(model, targets=("linear_fc1", "output_layer"), rank=4)
    assert all(p.requires_grad for p in model.parameters())
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks


@pytest.mark.parametrize(
    "recompute",
    [
        "none",
        "full",
    ],
)
def test_megatron_gpt_all_frozen_fills_sketches(groups, recompute):
    from megatron_logra.models.gpt import ModelConfig, build_gpt

    cfg = ModelConfig(recompute=recompute)
    ref = build_gpt(cfg, groups)
    model = build_gpt(cfg, groups)
    ss_ref = install_sketches(ref, rank=8, seed=1)  # embedding etc. trainable
    for p in model.parameters():
        p.requires_grad_(False)
    ss = install_sketches(model, rank=8, seed=1)
    batches = gpt_batches(n=1)
    gpt_step(ref, batches)
    gpt_step(model, batches)
    assert all(p.grad is None for p in model.parameters())
    assert float(ss_ref.flat.abs().max()) > 0
    # H and X do not depend on which parameters train: identical sketches
    assert torch.equal(ss.flat, ss_ref.flat)


# --------------------------------------------------------------------------- target names and aliases

_ALIAS_KIND = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "qkv_proj": "linear_qkv",
               "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
               "gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def test_alias_table_is_the_documented_one():
    from megatron_logra.sketch.naming import TARGET_ALIASES

    assert {a: k for a, k in TARGET_ALIASES.items() if a != k} == _ALIAS_KIND


def test_megatron_gpt_hf_alias_targets_select_the_fused_megatron_modules(groups):
    # docs/usage.md's LoGRA options: megatron has no q_proj leaf, q_proj selects the fused linear_qkv (whole weight)
    from megatron_logra.models.gpt import ModelConfig, build_gpt

    model = build_gpt(ModelConfig(), groups)
    ss = install_sketches(model, targets=("q_proj", "o_proj", "gate_up_proj", "down_proj"), rank=4)
    assert {t.module_name: t.name for t in ss.targets} == GPT_TARGETS
    assert {t.module_name: t.kind for t in ss.targets} == {
        f"decoder.layers.{i}.{k}": k.split(".")[-1] for i in range(2) for k in GPT_LEAVES}
    ss.remove()
    for alias, kind in _ALIAS_KIND.items():
        ss = install_sketches(model, targets=(alias,), rank=4)
        assert sorted(t.module_name for t in ss.targets) == [f"decoder.layers.{i}.{k}" for i in range(2)
                                                             for k in GPT_LEAVES if k.endswith(kind)], alias
        ss.remove()


class MegatronNamedLayer(nn.Module):
    """Leaf names of a megatron-core layer (plain linears): fast alias checks without megatron."""

    def __init__(self, d=8):
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(d, 3 * d, bias=False)
        self.self_attention.linear_proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(d, 4 * d, bias=False)
        self.mlp.linear_fc2 = nn.Linear(2 * d, d, bias=False)


def _megatron_named_model() -> nn.Module:
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList([MegatronNamedLayer(), MegatronNamedLayer()])
    model.output_layer = nn.Linear(8, 5, bias=False)
    return model


@pytest.mark.parametrize("alias, kind", sorted(_ALIAS_KIND.items()))
def test_each_alias_selects_its_megatron_kind(alias, kind):
    ss = install_sketches(_megatron_named_model(), targets=(alias,), rank=2)
    group = "mlp" if kind in ("linear_fc1", "linear_fc2") else "self_attention"
    assert sorted(t.module_name for t in ss.targets) == [f"decoder.layers.{i}.{group}.{kind}" for i in range(2)]
    assert {t.kind for t in ss.targets} == {kind}


def test_kinds_aliases_and_exact_leaf_names_mix_and_overlap():
    # an alias and its kind name the same module once; an exact leaf name (output_layer) still works
    ss = install_sketches(_megatron_named_model(), targets=("linear_qkv", "q_proj", "down_proj", "output_layer"), rank=2)
    assert sorted(t.module_name for t in ss.targets) == [
        "decoder.layers.0.mlp.linear_fc2", "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.self_attention.linear_qkv", "output_layer"]


def test_hf_alias_selects_every_projection_of_its_kind_in_an_hf_layout():
    # separate HF q/k/v read the same input and share one projection: q_proj names the kind, all three
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([HFLayer()])
    ss = install_sketches(model, targets=("q_proj",), rank=2)
    assert sorted(t.module_name for t in ss.targets) == [f"model.layers.0.self_attn.{p}" for p in ("k_proj", "q_proj",
                                                                                                     "v_proj")]
    assert {t.name for t in ss.targets} == {"model.layers.0.self_attn.qkv_proj"}


def test_an_alias_whose_kind_is_absent_is_refused_naming_its_kind():
    with pytest.raises(ValueError, match=r"targets \['q_proj'\] match no module of the model \(q_proj selects "
                                         r"linear_qkv\); known target names are"):
        install_sketches(make_mlp(), targets=("linear_fc1", "q_proj"), rank=4)

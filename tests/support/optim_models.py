"""Models, optimizer builders and naive references shared by the LoGRA optimizer tests
(``tests/unit/test_optim.py``, ``tests/unit/test_optim_bf16.py``): everything a reference is built
from, independent of the code under test except the projection ``A``, which is an input of the method."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from megatron_logra.optim import LograConfig, LograOptimizer, NativeConfig
from megatron_logra.parallel import ParallelGroups

GROUPS = ParallelGroups()  # one rank, no collectives
F64 = torch.float64
TARGETS = ("linear_fc1", "linear_fc2")


@pytest.fixture(autouse=True)
def single_thread():
    """The tensors of these tests are tiny: intra-op threads only add sync overhead (on a busy 2-core box a
    256x16 matmul takes 30 ms with 2 threads, 30 us with 1). Results do not depend on it. Autouse in every
    test module that imports it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MLP(nn.Module):
    """x -> [LayerNorm] -> linear_fc1 -> tanh -> linear_fc2 (leaf names are target kinds)."""

    def __init__(self, d_in: int = 16, hidden: int = 24, d_out: int = 12, bias: bool = False, norm: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d_in) if norm else nn.Identity()
        self.linear_fc1 = nn.Linear(d_in, hidden, bias=bias)
        self.linear_fc2 = nn.Linear(hidden, d_out, bias=bias)

    def forward(self, x):
        return self.linear_fc2(torch.tanh(self.linear_fc1(self.norm(x))))


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> MLP:
    torch.manual_seed(seed)
    model = MLP(**kw)
    with torch.no_grad():  # LayerNorm starts at ones/zeros: perturb so its grads are generic
        for name, p in model.named_parameters():
            if name.startswith("norm."):
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


def make_batch(seed: int, lead: tuple[int, ...], d_in: int = 16, d_out: int = 12, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=gen)
    y = torch.randn(*lead, d_out, generator=gen)
    return x.to(dtype), y.to(dtype)


def sum_loss(model, x, y):
    return 0.5 * (model(x) - y).pow(2).sum()


def mean_loss(model, x, y):
    return 0.5 * (model(x) - y).pow(2).mean()


class DenseRef:
    """An ordinary float64 copy of a model: dense gradients at weights the test sets."""

    def __init__(self, model: nn.Module):
        self.model = copy.deepcopy(model).double()
        for p in self.model.parameters():
            p.requires_grad_(True)

    def set_(self, name: str, value: torch.Tensor) -> None:
        with torch.no_grad():
            dict(self.model.named_parameters())[name].copy_(value)

    def grads(self, x, y, loss_fn) -> dict[str, torch.Tensor]:
        self.model.zero_grad(set_to_none=True)
        loss_fn(self.model, x.double(), y.double()).backward()
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}


def make_logra(model, targets=TARGETS, native: NativeConfig | None = None, **cfg) -> LograOptimizer:
    cfg.setdefault("rank", 8)
    cfg.setdefault("clip_grad", 0.0)
    return LograOptimizer(model, LograConfig(targets=list(targets), **cfg), native or NativeConfig(), GROUPS)


def proj(opt: LograOptimizer, target, update_index: int) -> torch.Tensor:
    return opt.sketches.projection_for(target, update_index).double()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def naive_row_adam(S: torch.Tensor, v: torch.Tensor, step: int, beta2: float, eps: float):
    """Per-row loop in float64; returns (D, new v)."""
    D = torch.empty_like(S, dtype=F64)
    v_new = torch.empty_like(v, dtype=F64)
    bias_corr = 1.0 - beta2**step
    for i in range(S.shape[0]):
        row = [float(s) for s in S[i]]
        vi = beta2 * float(v[i]) + (1.0 - beta2) * sum(s * s for s in row) / len(row)
        v_new[i] = vi
        denom = math.sqrt(vi / bias_corr) + eps
        for j, s in enumerate(row):
            D[i, j] = s / denom
    return D, v_new


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (normal range): 2^(floor(log2|x|) - 7)."""
    return torch.exp2(torch.floor(torch.log2(x.double().abs())) - 7)

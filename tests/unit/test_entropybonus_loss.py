"""The entropy bonus of the RL loss (``rl.loss.entropy_coef``): values, exact gradients, the coefficient 0.

The reference is dense float64: ``torch.distributions.Categorical(logits=z/τ).entropy()`` for the entropy and
autograd through ``torch.log_softmax`` for every gradient; the closed form ``∂H/∂z_v = −p_v(log p_v + H)/τ``
of the chunked backward is checked against that autograd once. At TP 1 (``tp_group=None``, the vocabulary
whole); ``tests/distributed/test_entropybonus_tp.py`` checks TP 2.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.rl.logprobs import chunked_logprobs_and_entropy
from megatron_logra.rl.losses import LossConfig, ppo_clip_loss, rl_loss, tis_pg_loss, token_logprobs_and_entropy
from megatron_logra.train.step import Batch

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _inputs(b: int, s: int, vocab: int, seed: int, dtype=F32):
    """Logits ``[b, s, V]`` (spread 3: entropies well inside (0, log V)), labels, a loss mask with holes,
    rollout log-probs and advantages ``[b, s]``."""
    gen = torch.Generator().manual_seed(seed)
    z_bsV = (torch.randn(b, s, vocab, generator=gen) * 3.0).to(dtype)
    labels_bs = torch.randint(0, vocab, (b, s), generator=gen)
    mask_bs = (torch.rand(b, s, generator=gen) < 0.7).float()
    mask_bs[0, 0], mask_bs[-1, -1] = 0.0, 1.0
    rollout_bs = -torch.rand(b, s, generator=gen) * 3.0
    adv_bs = torch.randn(b, s, generator=gen)
    return z_bsV, labels_bs, mask_bs, rollout_bs, adv_bs


def _dense_entropy(z_bsV: torch.Tensor, tau: float) -> torch.Tensor:
    """Float64 entropy per position, differentiable w.r.t. ``z_bsV`` (through ``log_softmax``)."""
    logq = torch.log_softmax(z_bsV.double() / tau, dim=-1)
    return -(logq.exp() * logq).sum(-1)


def _batch(labels_bs, mask_bs, rollout_bs, adv_bs) -> Batch:
    b, s = labels_bs.shape
    return Batch(tokens=torch.zeros(b, s, dtype=torch.long), labels=labels_bs, loss_mask=mask_bs,
                 position_ids=torch.arange(s)[None].expand(b, s),
                 extras={"advantages": adv_bs, "rollout_logprobs": rollout_bs, "finished": torch.ones(b, s)})


@pytest.mark.parametrize("chunk", [1, 5, 0, 4096], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_chunked_entropy_and_its_gradient_equal_the_dense_reference(chunk, tau):
    z, labels, mask, _, _ = _inputs(3, 7, 61, seed=chunk + 17)
    zc = z.clone().requires_grad_(True)
    _, ent = chunked_logprobs_and_entropy(zc, labels, tau, None, chunk)
    want = torch.distributions.Categorical(logits=z.double() / tau).entropy()
    torch.testing.assert_close(ent.double(), want, rtol=1e-5, atol=2e-6)
    assert 0.01 < want.min().item() and want.max().item() < math.log(61)  # neither one-hot nor uniform
    # the gradient of the masked sum (what the loss differentiates) against autograd through log_softmax
    (g,) = torch.autograd.grad((ent * mask).sum(), zc)
    zr = z.double().requires_grad_(True)
    (gr,) = torch.autograd.grad((_dense_entropy(zr, tau) * mask.double()).sum(), zr)
    torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-6)
    assert g[mask == 0].abs().max().item() == 0.0  # positions off the mask get no gradient
    assert g[mask == 1].abs().max().item() > 1e-3


def test_entropy_gradient_closed_form():
    """``∂H/∂z_v = −p_v (log p_v + H) / τ``, checked against autograd in float64 (not assumed)."""
    z, _, _, _, _ = _inputs(2, 4, 13, seed=3)
    tau = 0.8
    zr = z.double().requires_grad_(True)
    h = _dense_entropy(zr, tau)
    (gr,) = torch.autograd.grad(h.sum(), zr)
    logq = torch.log_softmax(z.double() / tau, -1)
    closed = -logq.exp() * (logq + h.detach()[..., None]) / tau
    torch.testing.assert_close(gr, closed, rtol=1e-10, atol=1e-12)
    # and a wrong sign or a missing 1/τ would not pass
    assert not torch.allclose(gr, closed * tau, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kind", ["tis", "ppo"])
@pytest.mark.parametrize("chunk", [3, 0])
def test_rl_loss_with_the_bonus_equals_the_loss_without_minus_coef_times_the_entropy_sum(kind, chunk):
    from megatron_logra.rl.objective import make_rl_loss_fn

    coef, tau = 0.03, 0.9
    z, labels, mask, rollout, adv = _inputs(2, 6, 37, seed=5 + chunk)
    batch = _batch(labels, mask, rollout, adv)
    out = {}
    for c in (0.0, coef):
        zc = z.clone().requires_grad_(True)
        loss, ntok, report = make_rl_loss_fn(LossConfig(kind=kind, entropy_coef=c, logprob_chunk_tokens=chunk),
                                             tau, None)(batch, zc)
        loss.backward()
        out[c] = (loss.detach().double(), zc.grad.double(), report)
    # the dense reference of the whole objective, and its gradient
    zr = z.double().requires_grad_(True)
    logq = torch.log_softmax(zr / tau, -1)
    logp = logq.gather(-1, labels[..., None])[..., 0]
    if kind == "tis":
        pg = tis_pg_loss(logp, rollout.double(), adv.double(), mask.double(), 2.0)
    else:
        pg = ppo_clip_loss(logp, rollout.double(), adv.double(), mask.double(), 0.2, 0.28)
    h_sum = (_dense_entropy(zr, tau) * mask.double()).sum()
    ref = pg - coef * h_sum
    (gr,) = torch.autograd.grad(ref, zr)
    assert out[coef][0].item() == pytest.approx(out[0.0][0].item() - coef * h_sum.item(), rel=1e-6, abs=1e-6)
    assert out[coef][0].item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(out[coef][1], gr, rtol=1e-4, atol=1e-6)
    # the bonus moves the gradient by coef·∂ΣH/∂z (not a no-op), and the metric is the same either way
    assert (out[coef][1] - out[0.0][1]).abs().max().item() > 1e-4
    assert out[coef][2]["entropy"].tolist() == out[0.0][2]["entropy"].tolist()
    assert out[coef][2]["entropy"][0].item() == pytest.approx(h_sum.item(), rel=1e-5)
    assert out[coef][2]["lm"][0].item() == pytest.approx(out[coef][0].item(), rel=1e-6)  # lm: the whole objective


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_coefficient_zero_is_bitwise_the_loss_and_gradient_without_the_option(dtype):
    """``entropy_coef=0`` (default) against the objective as it was built before the option: the log-prob of
    the chunked pass into TIS, the entropy only a metric."""
    from megatron_logra.rl.objective import make_rl_loss_fn

    z, labels, mask, rollout, adv = _inputs(3, 5, 29, seed=11, dtype=dtype)
    batch = _batch(labels, mask, rollout, adv)
    zc = z.clone().requires_grad_(True)
    loss, _, _ = make_rl_loss_fn(LossConfig(entropy_coef=0.0, logprob_chunk_tokens=4), 1.1, None)(batch, zc)
    loss.backward()
    zp = z.clone().requires_grad_(True)
    logp, _ = token_logprobs_and_entropy(zp, labels, 1.1, None, 4)
    before = tis_pg_loss(logp, rollout, adv, mask, LossConfig().tis_cap)
    before.backward()
    assert torch.equal(loss.detach(), before.detach())
    assert torch.equal(zc.grad, zp.grad)
    # the entropy is not part of the loss's graph at 0: no gradient reaches it, so backward skips its term
    logp, ent = token_logprobs_and_entropy(z.clone().requires_grad_(True), labels, 1.1, None, 4)
    zero = rl_loss(LossConfig(), logp, rollout, adv, mask, entropy=ent)
    assert torch.autograd.grad(zero, ent, allow_unused=True) == (None,)
    assert torch.equal(zero.detach(), rl_loss(LossConfig(), logp, rollout, adv, mask).detach())


def test_a_positive_coefficient_needs_the_entropy():
    z, labels, mask, rollout, adv = _inputs(1, 3, 7, seed=2)
    logp, _ = token_logprobs_and_entropy(z, labels, 1.0, None, 0)
    with pytest.raises(ValueError, match="entropy_coef"):
        rl_loss(LossConfig(entropy_coef=0.1), logp, rollout, adv, mask)


def test_config_validation():
    assert LossConfig().entropy_coef == 0.0
    assert LossConfig(entropy_coef=0.01).entropy_coef == 0.01
    assert LossConfig(entropy_coef=0).entropy_coef == 0
    for bad in (-0.01, float("nan"), float("inf"), -float("inf"), True, "0.1", None):
        with pytest.raises(ValueError, match=r"rl\.loss\.entropy_coef"):
            LossConfig(entropy_coef=bad)


def test_the_override_reaches_the_config():
    from megatron_logra.config import parse_args_to_config

    assert parse_args_to_config("tiny", ["rl.loss.entropy_coef=0.02"]).rl.loss.entropy_coef == 0.02
    with pytest.raises(ValueError, match=r"rl\.loss\.entropy_coef"):
        parse_args_to_config("tiny", ["rl.loss.entropy_coef=-1"])



def test_the_bonus_saves_nothing_more_for_backward():
    """What autograd keeps between the loss's forward and backward over bf16 logits ``[T, V]``: with the bonus
    what the log-prob path keeps without it (the logits themselves, no fp32 ``[T, V]`` tensor, ``[T]`` vectors)
    and one ``[T]`` vector more: the bonus's gradient is formed chunk by chunk in the buffers the backward
    already uses."""
    from megatron_logra.rl.objective import make_rl_loss_fn

    t, vocab = 64, 512
    z, labels, mask, rollout, adv = _inputs(1, t, vocab, seed=23, dtype=BF16)
    batch = _batch(labels, mask, rollout, adv)
    saved = {}
    for coef in (0.0, 0.01):
        zc = z.clone().requires_grad_(True)
        kept: list[tuple] = []

        def pack(x: torch.Tensor):
            kept.append((tuple(x.shape), x.dtype, x.data_ptr() == zc.data_ptr()))
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss, _, _ = make_rl_loss_fn(LossConfig(entropy_coef=coef, logprob_chunk_tokens=16), 1.0, None)(batch, zc)
        loss.backward()
        saved[coef] = sorted(kept, key=repr)
    extra = list(saved[0.01])
    for k in saved[0.0]:
        extra.remove(k)  # everything saved without the bonus is saved with it
    assert extra and all(math.prod(shape) <= t for shape, _, _ in extra), extra  # the mask for Σ H·mask: [T]
    big = [k for k in saved[0.01] if math.prod(k[0]) > t]
    assert big == [((t, vocab), BF16, True)], big  # the logits themselves, no copy and nothing fp32

"""Chunked log-probs / entropy (rl/logprobs.py) equal the dense ``log_softmax`` reference.

The reference is written out in float64 from the definitions (``log_softmax(z/τ)`` gathered at the
label; ``−Σ p log p``); gradients of the reference come from autograd on that float64 graph, and
are also checked against the closed form ``(1[v = label] − p_v)/τ`` once.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.rl.logprobs import (DEFAULT_CHUNK_TOKENS, chunked_logprobs_and_entropy, chunked_token_logprobs,
                                        token_entropy)
from megatron_logra.rl.losses import LossConfig, token_logprobs, token_logprobs_and_entropy

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _reference(z: torch.Tensor, labels: torch.Tensor, tau: float):
    """(logp, entropy) in float64 from the definitions, differentiable w.r.t. ``z``."""
    logq = torch.log_softmax(z.double() / tau, dim=-1)
    logp = logq.gather(-1, labels[..., None])[..., 0]
    entropy = -(logq.exp() * logq).sum(-1)
    return logp, entropy


def _inputs(shape, vocab, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(*shape, vocab, generator=gen) * scale).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    c_logp = torch.randn(*shape, generator=gen)
    c_ent = torch.randn(*shape, generator=gen)
    return z, labels, c_logp, c_ent


# tolerances: fp32 inputs agree to fp32 rounding; bf16 inputs are exact in fp32, so values agree
# alike, and bf16 gradients agree to one bf16 rounding of the fp32 gradient
TOL = {F32: dict(rtol=1e-5, atol=2e-6), BF16: dict(rtol=1e-5, atol=2e-6)}
GRAD_TOL = {F32: dict(rtol=1e-4, atol=2e-6), BF16: dict(rtol=1.6e-2, atol=1e-5)}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 7, 13, 0, 1000], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("tau", [1.0, 0.6, 1.7])
def test_values_and_gradients_match_dense(dtype, chunk, tau):
    z, labels, c_logp, c_ent = _inputs((3, 9), 53, dtype, seed=chunk + int(10 * tau))
    zc = z.clone().requires_grad_(True)
    logp, entropy = chunked_logprobs_and_entropy(zc, labels, tau, None, chunk)
    assert logp.shape == entropy.shape == (3, 9) and logp.dtype == entropy.dtype == F32
    zr = z.clone().requires_grad_(True)
    ref_logp, ref_entropy = _reference(zr, labels, tau)
    torch.testing.assert_close(logp.double(), ref_logp, **TOL[dtype])
    torch.testing.assert_close(entropy.double(), ref_entropy, **TOL[dtype])
    # both outputs differentiated at once, then each alone
    for cl, ce in ((c_logp, c_ent), (c_logp, None), (None, c_ent)):
        got_loss = sum(((out * c).sum() for out, c in ((logp, cl), (entropy, ce)) if c is not None), torch.zeros(()))
        ref_loss = sum(((out * c.double()).sum() for out, c in ((ref_logp, cl), (ref_entropy, ce)) if c is not None),
                       torch.zeros((), dtype=F64))
        (g,) = torch.autograd.grad(got_loss, zc, retain_graph=True)
        (gr,) = torch.autograd.grad(ref_loss, zr, retain_graph=True)
        assert g.dtype == dtype and g.shape == z.shape
        torch.testing.assert_close(g.double(), gr.to(dtype).double(), **GRAD_TOL[dtype])


def test_gradient_closed_form_and_inputs_untouched():
    # ∂ Σ c·logp / ∂z_v = c·(1[v = label] − p_v)/τ
    z, labels, c, _ = _inputs((2, 5), 11, F32, seed=3)
    before = z.clone()
    zc = z.clone().requires_grad_(True)
    tau = 0.7
    (chunked_token_logprobs(zc, labels, tau, None, 3) * c).sum().backward()
    p = torch.softmax(z.double() / tau, -1)
    onehot = torch.nn.functional.one_hot(labels, 11).double()
    torch.testing.assert_close(zc.grad.double(), c.double()[..., None] * (onehot - p) / tau, rtol=1e-5, atol=2e-6)
    # fp32 logits are worked on in copies: the caller's logits are unchanged
    assert torch.equal(zc.detach(), before)


@pytest.mark.parametrize("chunk", [1, 4, 0])
def test_entropy_alone_matches_dense(chunk):
    z, labels, _, c = _inputs((4, 3), 29, F32, seed=5)
    zc = z.clone().requires_grad_(True)
    zr = z.clone().requires_grad_(True)
    ent = token_entropy(zc, 0.8, None, chunk)
    _, ref = _reference(zr, labels, 0.8)
    torch.testing.assert_close(ent.double(), ref, rtol=1e-5, atol=2e-6)
    (g,) = torch.autograd.grad((ent * c).sum(), zc)
    (gr,) = torch.autograd.grad((ref * c.double()).sum(), zr)
    torch.testing.assert_close(g.double(), gr.double(), rtol=1e-4, atol=2e-6)


def test_logprobs_alone_and_wrapper_match():
    z, labels, _, _ = _inputs((2, 6), 19, BF16, seed=7)
    ref, _ = _reference(z, labels, 1.3)
    for out in (chunked_token_logprobs(z, labels, 1.3, None, 5), token_logprobs(z, labels, 1.3, None),
                token_logprobs(z, labels, 1.3, None, 2), token_logprobs_and_entropy(z, labels, 1.3, None, 3)[0]):
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6)


def test_masked_and_infinite_columns():
    # padded columns at -1e4 (models.gpt.mask_padded_vocab) or -inf carry no probability: the result equals
    # the dense one over the real columns only, and stays finite (entropy terms 0·log 0 = 0)
    z, labels, c_logp, c_ent = _inputs((3, 4), 12, F32, seed=9)
    for fill in (-1.0e4, float("-inf")):
        zp = torch.cat([z, torch.full((3, 4, 4), fill)], dim=-1).requires_grad_(True)
        logp, ent = chunked_logprobs_and_entropy(zp, labels, 0.9, None, 5)
        ref_logp, ref_ent = _reference(z, labels, 0.9)
        torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=2e-6)
        (g,) = torch.autograd.grad((logp * c_logp + ent * c_ent).sum(), zp)
        assert torch.isfinite(g).all()
        assert g[..., 12:].abs().max().item() == 0.0


def test_no_grad_and_shapes():
    z, labels, _, _ = _inputs((5,), 7, F32, seed=11)  # [T, V] input, no batch dim
    with torch.no_grad():
        logp = chunked_token_logprobs(z.requires_grad_(True), labels, 1.0, None, 2)
    assert logp.shape == (5,) and not logp.requires_grad
    ref, _ = _reference(z.detach(), labels, 1.0)
    torch.testing.assert_close(logp.double(), ref, rtol=1e-5, atol=2e-6)


def test_bad_arguments():
    z, labels, _, _ = _inputs((2, 3), 5, F32)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(z, labels, 0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(z, labels, 1.0, None, -1)
    with pytest.raises(ValueError, match="do not match"):
        chunked_token_logprobs(z, labels[:, :2], 1.0)


def test_loss_config_knob():
    assert LossConfig().logprob_chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert LossConfig(logprob_chunk_tokens=0).logprob_chunk_tokens == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="logprob_chunk_tokens"):
            LossConfig(logprob_chunk_tokens=bad)


def test_rl_loss_fn_uses_the_chunk_knob_and_reports_entropy():
    from megatron_logra.rl.loop import make_rl_loss_fn
    from megatron_logra.train.step import Batch

    z, labels, adv, _ = _inputs((2, 5), 17, F32, seed=13)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0]])
    batch = Batch(tokens=torch.zeros(2, 5, dtype=torch.long), labels=labels, loss_mask=mask,
                  position_ids=torch.arange(5)[None].expand(2, 5),
                  extras={"advantages": adv, "rollout_logprobs": torch.full((2, 5), -2.5), "finished": torch.ones(2, 5)})
    out = {}
    for chunk in (0, 3):
        zc = z.clone().requires_grad_(True)
        loss, ntok, report = make_rl_loss_fn(LossConfig(logprob_chunk_tokens=chunk), 0.9, None)(batch, zc)
        loss.backward()
        out[chunk] = (loss.detach(), zc.grad, report)
    torch.testing.assert_close(out[3][0], out[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[3][1], out[0][1], rtol=1e-5, atol=1e-7)
    _, ref_entropy = _reference(z, labels, 0.9)
    entropy_sum, tokens = out[3][2]["entropy"].tolist()
    assert tokens == 7.0  # 3 + 4 loss tokens
    assert entropy_sum == pytest.approx((ref_entropy * mask.double()).sum().item(), rel=1e-5)

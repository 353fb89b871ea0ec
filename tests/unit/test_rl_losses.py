"""RL building blocks on tiny hand-built tensors: advantages, losses, token log-probs, batching.

Every expected value is written out by hand next to its assertion (the arithmetic is in the
comments); gradients are compared against closed forms, not against a second autograd run
of the code under test.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_logra.rl.advantages import EMABaseline, grpo_advantages
from megatron_logra.rl.batching import pack_sequences, split_microbatches
from megatron_logra.rl.losses import LossConfig, kl_penalty, ppo_clip_loss, rl_loss, tis_pg_loss, token_logprobs
from megatron_logra.train.step import Batch

F32, F64 = torch.float32, torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""

# --------------------------------------------------------------------------- advantages


def test_grpo_advantages_with_std_scaling():
    # group 1 = [0, 1, 2]: mean 1, centred [-1, 0, 1], population std sqrt((1 + 0 + 1)/3) = sqrt(2/3)
    #   -> [-1, 0, 1] / (sqrt(2/3) + eps)
    # group 2 = [5, 5, 5]: centred [0, 0, 0] (std 0, eps keeps it finite) -> zeros
    eps = 1e-6
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0, 5.0, 5.0])
    adv = grpo_advantages(rewards, 3, scale_by_std=True, eps=eps)
    s = 1.0 / (math.sqrt(2.0 / 3.0) + eps)  # = 1.2247434...
    assert adv.dtype == F32 and adv.shape == (6,)
    torch.testing.assert_close(adv, torch.tensor([-s, 0.0, s, 0.0, 0.0, 0.0]), rtol=1e-6, atol=1e-7)
    # eps = 0: exactly ±sqrt(3/2) = ±1.2247448...
    adv0 = grpo_advantages(rewards, 3, scale_by_std=True, eps=0.0)
    assert adv0[0].item() == pytest.approx(-math.sqrt(1.5), rel=1e-6)


def test_grpo_advantages_without_std_scaling():
    # Dr.GRPO: group [3, 1] mean 2 -> [1, -1]; group [0, 4] mean 2 -> [-2, 2] (no division)
    rewards = torch.tensor([3.0, 1.0, 0.0, 4.0])
    adv = grpo_advantages(rewards, 2, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -2.0, 2.0]))
    # with std: both groups have population std 1 resp. 2 -> [1, -1] and [-1, 1]
    adv_std = grpo_advantages(rewards, 2, scale_by_std=True, eps=0.0)
    torch.testing.assert_close(adv_std, torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_grpo_uniform_groups_give_zeros():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    for scale in (True, False):
        adv = grpo_advantages(rewards, 4, scale_by_std=scale)
        assert torch.equal(adv, torch.zeros(8))
    # integer rewards come back as float32
    assert grpo_advantages(torch.tensor([1, 1, 0, 2]), 2).dtype == F32


def test_grpo_uniform_groups_give_exact_zeros_at_eps_0_and_with_an_inexact_mean():
    # eps = 0 (allowed): a uniform group is 0/0 unless it is recognised as uniform
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4, scale_by_std=True, eps=0.0)
    assert torch.equal(adv, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]))  # std 0.5, centred ±0.5
    # 0.1 (float64) three times: 0.1 + 0.1 + 0.1 rounds, so the mean is not 0.1 and the centred rewards are
    # rounding-sized; divided by a rounding-sized std they would be ±1 instead of 0
    x = torch.tensor([0.1, 0.1, 0.1], dtype=F64)
    assert float(x.mean()) != 0.1  # the premise
    for scale, eps in ((True, 0.0), (True, 1e-6), (False, 1e-6)):
        assert torch.equal(grpo_advantages(x, 3, scale_by_std=scale, eps=eps), torch.zeros(3, dtype=F64)), (scale, eps)


@pytest.mark.parametrize("n, g", [(5, 2), (4, 0), (4, -1), (6, 4)])
def test_grpo_bad_group_size_raises(n, g):
    with pytest.raises(ValueError, match="groups of"):
        grpo_advantages(torch.zeros(n), g)


def test_ema_baseline_three_batches():
    b = EMABaseline(weight=0.5)
    # batch 1 [1, 3]: mean 2 initialises b = 2 -> A = [-1, 1]; then b = 0.5·2 + 0.5·2 = 2
    torch.testing.assert_close(b.advantages(torch.tensor([1.0, 3.0])), torch.tensor([-1.0, 1.0]))
    assert b.value == pytest.approx(2.0) and b.initialised
    # batch 2 [4, 6]: A = r − 2 = [2, 4]; then b = 0.5·2 + 0.5·5 = 3.5
    torch.testing.assert_close(b.advantages(torch.tensor([4.0, 6.0])), torch.tensor([2.0, 4.0]))
    assert b.value == pytest.approx(3.5)
    # batch 3 [0, 1]: A = r − 3.5 = [-3.5, -2.5]; then b = 0.5·3.5 + 0.5·0.5 = 2.0
    torch.testing.assert_close(b.advantages(torch.tensor([0.0, 1.0])), torch.tensor([-3.5, -2.5]))
    assert b.value == pytest.approx(2.0)
    # checkpoint round trip
    other = EMABaseline(weight=0.5)
    other.load_state_dict(b.state_dict())
    assert other.value == pytest.approx(2.0) and other.initialised
    # next batch [2, 2]: A = [0, 0] against the restored b = 2
    torch.testing.assert_close(other.advantages(torch.tensor([2.0, 2.0])), torch.zeros(2))


def test_ema_baseline_default_weight():
    b = EMABaseline()  # weight 0.1
    b.advantages(torch.tensor([2.0]))  # b = 2
    adv = b.advantages(torch.tensor([12.0]))  # A = 12 − 2 = 10; b = 0.9·2 + 0.1·12 = 3.0
    torch.testing.assert_close(adv, torch.tensor([10.0]))
    assert b.value == pytest.approx(3.0)


# --------------------------------------------------------------------------- losses


def test_tis_pg_loss_value_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -2.5, -2.0, -3.0]])
    adv = torch.tensor([[0.5, -1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    cap = 2.0
    # w = min(exp(logp − rollout), 2) = [exp 0, exp 0.5, min(exp 1.5, 2), exp 0] = [1, 1.6487213, 2, 1]
    w = [1.0, math.exp(0.5), 2.0, 1.0]
    # loss = −Σ w·A·logp·mask = −(1·0.5·(−1) + 1.6487·(−1)·(−2) + 2·2·(−0.5) + 0) = −(−0.5 + 3.2974425 − 2)
    expected = -(-0.5 + w[1] * 2.0 - 2.0)
    loss = tis_pg_loss(logp, rollout, adv, mask, cap)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # ∇logp = −w·A·mask with w detached = [−0.5, 1.6487213, −4, 0]
    # (a non-detached w would add −w·A·logp on the uncapped tokens: [−1, 4.946, −4, 0])
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, w[1], -4.0, 0.0]]), rtol=1e-6, atol=1e-7)


def test_ppo_clip_loss_clip_higher():
    eps_low, eps_high = 0.2, 0.28  # trust region [0.8, 1.28]
    ratios = [1.5, 1.25, 1.1, 0.5, 1.5, 1.1, 0.78, 0.5]
    adv = [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]
    # per token −min(ρA, clip(ρ, 0.8, 1.28)·A) and its ∂/∂logp (ρ' = ρ): −ρA if unclipped else 0
    #   A=+1 ρ=1.5  : min(1.5, 1.28)   = 1.28  clipped   -> −1.28, grad 0
    #   A=+1 ρ=1.25 : min(1.25, 1.25)  = 1.25  inside (a symmetric ε=0.2 would clip at 1.2) -> −1.25, grad −1.25
    #   A=+1 ρ=1.1  : inside                    -> −1.1,  grad −1.1
    #   A=+1 ρ=0.5  : min(0.5, 0.8)    = 0.5   unclipped -> −0.5,  grad −0.5
    #   A=−1 ρ=1.5  : min(−1.5, −1.28) = −1.5  unclipped -> +1.5,  grad +1.5
    #   A=−1 ρ=1.1  : inside                    -> +1.1,  grad +1.1
    #   A=−1 ρ=0.78 : min(−0.78, −0.8) = −0.8  clipped   -> +0.8,  grad 0
    #   A=−1 ρ=0.5  : min(−0.5, −0.8)  = −0.8  clipped   -> +0.8,  grad 0
    per_token = [-1.28, -1.25, -1.1, -0.5, 1.5, 1.1, 0.8, 0.8]
    grads = [0.0, -1.25, -1.1, -0.5, 1.5, 1.1, 0.0, 0.0]
    old = torch.tensor([[-1.0, -2.0, -0.3, -1.7, -0.9, -2.2, -1.1, -0.4]], dtype=F64)
    logp = (old + torch.log(torch.tensor([ratios], dtype=F64))).requires_grad_(True)
    a = torch.tensor([adv], dtype=F64)
    loss = ppo_clip_loss(logp, old, a, torch.ones(1, 8, dtype=F64), eps_low, eps_high)
    assert loss.item() == pytest.approx(sum(per_token), abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([grads], dtype=F64), rtol=1e-12, atol=1e-12)
    # the mask drops tokens: keep only tokens 0 and 4 -> −1.28 + 1.5
    mask = torch.zeros(1, 8, dtype=F64)
    mask[0, [0, 4]] = 1.0
    assert ppo_clip_loss(logp, old, a, mask, eps_low, eps_high).item() == pytest.approx(0.22, abs=1e-12)


def test_kl_penalty_k1_k2_k3():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    ones, first = torch.ones(1, 2, dtype=F64), torch.tensor([[1.0, 0.0]], dtype=F64)
    # k1 = logp − ref = [0.5, −1.0] -> sum −0.5
    assert kl_penalty(logp, ref, ones, "k1").item() == pytest.approx(-0.5, abs=1e-12)
    # k3 with x = ref − logp = [−0.5, 1.0]: exp(x) − x − 1
    #   = [0.6065307 + 0.5 − 1, 2.7182818 − 1 − 1] = [0.1065307, 0.7182818] -> sum 0.8248125
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
    assert kl_penalty(logp, ref, ones, "k3").item() == pytest.approx(sum(k3), abs=1e-12)
    assert kl_penalty(logp, ref, first, "k3").item() == pytest.approx(k3[0], abs=1e-12)
    assert kl_penalty(logp, ref, ones).item() == pytest.approx(sum(k3), abs=1e-12)  # default k3
    # k2 = x² / 2 = [0.125, 0.5]
    assert kl_penalty(logp, ref, ones, "k2").item() == pytest.approx(0.625, abs=1e-12)
    # identical policies: every estimator is 0
    for estimator in ("k1", "k2", "k3"):
        assert kl_penalty(logp, logp.clone(), ones, estimator).item() == 0.0
    with pytest.raises(ValueError, match="estimator='k4'"):
        kl_penalty(logp, ref, ones, "k4")


@pytest.mark.parametrize("estimator, direction", [("k1", None), ("k2", "forward"), ("k3", "reverse")])
def test_the_penalty_pulls_along_the_gradient_its_docstring_names(estimator, direction):
    """Exact expectation over a categorical policy (every token y weighted by π_θ(y), the samples held
    fixed as on-policy sampling does): E[∇ k(y)] against autograd's gradient of the exact KL.
    k2 gives ∇KL(π_θ‖π_ref), k3 ∇KL(π_ref‖π_θ), k1 zero (why the loss refuses it)."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(7, generator=gen, dtype=F64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=F64), -1)
    logp = torch.log_softmax(z, -1)
    p = logp.exp().detach()  # the sampling distribution: no gradient through the samples
    expected_penalty = sum(p[y] * kl_penalty(logp[y].reshape(1, 1), ref[y].reshape(1, 1), torch.ones(1, 1, dtype=F64),
                                             estimator) for y in range(7))
    (got,) = torch.autograd.grad(expected_penalty, z, retain_graph=True)
    q = ref.exp()
    forward_kl = (logp.exp() * (logp - ref)).sum()
    reverse_kl = (q * (ref - logp)).sum()
    if direction is None:
        torch.testing.assert_close(got, torch.zeros_like(got), atol=1e-12, rtol=0)
        with pytest.raises(ValueError, match="kl_estimator=k1 has an expected gradient of zero"):
            LossConfig(kl_estimator="k1")
        return
    (want,) = torch.autograd.grad(forward_kl if direction == "forward" else reverse_kl, z)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_rl_loss_dispatch_and_kl_needs_reference():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    rollout = torch.tensor([[-1.0, -1.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="reference"):
        rl_loss(LossConfig(kl_coef=0.1), logp, rollout, adv, mask, None)
    # TIS: w = [1, exp(−1)] -> −(1·1·(−1) + e⁻¹·1·(−2)) = 1 + 2e⁻¹ = 1.7357589
    tis = 1.0 + 2.0 * math.exp(-1.0)
    assert rl_loss(LossConfig(), logp, rollout, adv, mask).item() == pytest.approx(tis, abs=1e-12)
    # + 0.1 · k3 (values from test_kl_penalty_k1_k3: 0.8248125)
    k3 = math.exp(-0.5) - 0.5 + math.e - 2.0
    got = rl_loss(LossConfig(kl_coef=0.1), logp, rollout, adv, mask, ref).item()
    assert got == pytest.approx(tis + 0.1 * k3, abs=1e-12)
    # + 0.1 · k2: x = [−0.5, 1.0] -> (0.25 + 1) / 2 = 0.625
    got = rl_loss(LossConfig(kl_coef=0.1, kl_estimator="k2"), logp, rollout, adv, mask, ref).item()
    assert got == pytest.approx(tis + 0.0625, abs=1e-12)
    # PPO: ρ = [1, e⁻¹ = 0.368] with A = +1: min(1, 1) = 1 and min(0.368, 0.8) = 0.368 -> −1.3678794
    got = rl_loss(LossConfig(kind="ppo"), logp, rollout, adv, mask).item()
    assert got == pytest.approx(-(1.0 + math.exp(-1.0)), abs=1e-12)


# --------------------------------------------------------------------------- token log-probs


def test_token_logprobs_values_and_gradients(groups):
    gen = torch.Generator().manual_seed(0)
    b, s, v, tau = 2, 3, 7, 0.7
    z = (torch.randn(b, s, v, generator=gen) * 2.0).requires_grad_(True)
    labels = torch.randint(0, v, (b, s), generator=gen)
    out = token_logprobs(z, labels, tau, groups.tp)
    assert out.shape == (b, s)
    # reference: log_softmax(z/τ)[label], written out in float64
    zd = z.detach().double() / tau
    lse = torch.logsumexp(zd, dim=-1)
    ref = zd.gather(-1, labels[..., None])[..., 0] - lse
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # gradient of Σ c·logp: ∂/∂z_v = c·(1[v = label] − p_v)/τ, p = softmax(z/τ)
    c = torch.randn(b, s, generator=gen)
    (out * c).sum().backward()
    p = torch.softmax(zd, dim=-1)
    onehot = torch.nn.functional.one_hot(labels, v).double()
    expected = c.double()[..., None] * (onehot - p) / tau
    torch.testing.assert_close(z.grad.double(), expected, rtol=1e-5, atol=1e-6)


def test_make_rl_loss_fn_loss_and_mismatch_report(groups):
    from megatron_logra.rl.loop import make_rl_loss_fn

    gen = torch.Generator().manual_seed(1)
    v = 5
    logits = torch.randn(2, 3, v, generator=gen, requires_grad=True)
    labels = torch.tensor([[1, 2, 3], [4, 0, 1]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rollout = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -1.5, 0.0]])
    adv = torch.tensor([[0.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    finished = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # only sequence 0 completed
    batch = Batch(tokens=torch.zeros(2, 3, dtype=torch.long), labels=labels, loss_mask=mask,
                  position_ids=torch.arange(3)[None].expand(2, 3),
                  extras={"advantages": adv, "rollout_logprobs": rollout, "finished": finished})
    fn = make_rl_loss_fn(LossConfig(), 1.0, groups.tp)
    loss, ntok, report = fn(batch, logits)
    logp = torch.log_softmax(logits.detach().double(), -1).gather(-1, labels[..., None])[..., 0]
    w = torch.exp(logp - rollout.double()).clamp(max=2.0)
    assert loss.item() == pytest.approx(-(w * adv.double() * logp * mask.double()).sum().item(), rel=1e-5)
    assert int(ntok) == 4
    # mismatch = Σ (rollout − trainer) over tokens of completed sequences = positions (0,1), (0,2)
    gap = (rollout[0, 1] - logp[0, 1]) + (rollout[0, 2] - logp[0, 2])
    assert report["mismatch"][0].item() == pytest.approx(gap.item(), rel=1e-5)
    assert report["mismatch"][1].item() == 2.0


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_make_rl_loss_fn_reports_the_kl_to_the_reference(groups, estimator):
    """``ref_kl`` = Σ over loss tokens of the penalty's per-token estimator of KL(π_θ ‖ π_ref), written
    out here from its definition (k2 = (log π_θ − log π_ref)² / 2, k3 = r − log r − 1 with r = π_ref / π_θ);
    the loss carries ``kl_coef`` times the same sum. Without reference log-probs the report is [0, 0]."""
    from megatron_logra.rl.loop import make_rl_loss_fn

    gen = torch.Generator().manual_seed(2)
    v = 6
    logits = torch.randn(2, 4, v, generator=gen)
    labels = torch.randint(0, v, (2, 4), generator=gen)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    ref = torch.log_softmax(torch.randn(2, 4, v, generator=gen).double(), -1).gather(-1, labels[..., None])[..., 0]
    extras = {"advantages": torch.zeros(2, 4), "rollout_logprobs": torch.zeros(2, 4), "finished": torch.zeros(2, 4)}
    batch = Batch(tokens=torch.zeros(2, 4, dtype=torch.long), labels=labels, loss_mask=mask,
                  position_ids=torch.arange(4)[None].expand(2, 4), extras=dict(extras, ref_logprobs=ref.float()))
    coef = 0.25
    loss, _, report = make_rl_loss_fn(LossConfig(kl_coef=coef, kl_estimator=estimator), 1.0, groups.tp)(batch, logits)

    logp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    if estimator == "k2":
        per_token = 0.5 * (logp - ref) ** 2
    else:
        r = torch.exp(ref - logp)
        per_token = r - torch.log(r) - 1
    want = (per_token * mask.double()).sum().item()
    assert abs(want) > 0.1
    assert report["ref_kl"][0].item() == pytest.approx(want, rel=1e-5)
    assert report["ref_kl"][1].item() == mask.sum().item() == 5
    assert loss.item() == pytest.approx(coef * want, rel=1e-5, abs=1e-6)  # zero advantages: the penalty alone

    plain = Batch(tokens=batch.tokens, labels=labels, loss_mask=mask, position_ids=batch.position_ids, extras=extras)
    _, _, report = make_rl_loss_fn(LossConfig(), 1.0, groups.tp)(plain, logits)
    assert report["ref_kl"].tolist() == [0.0, 0.0]


# --------------------------------------------------------------------------- batching


def _pack(**kw):
    args = dict(
        prompts=[[1, 2, 3], [4, 5]],
        completions=[[6, 7], [8, 9, 10, 11]],
        rollout_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5, -0.6]],
        advantages=[0.5, -1.5],
        finished=[True, False],
        pad_id=99,
        max_length=47,
    )
    args.update(kw)
    return pack_sequences(**args)


def test_pack_sequences_layout():
    batch = _pack()
    # seq 0 = [1 2 3 | 6 7] -> tokens [1 2 3 6], labels [2 3 6 7]; labels 6, 7 sit at positions 2, 3
    # seq 1 = [4 5 | 8 9 10 11] -> tokens [4 5 8 9 10], labels [5 8 9 10 11]; completion labels at 1..4
    # longest = 5 positions -> padded to 8
    P = 99
    assert torch.equal(batch.tokens, torch.tensor([[1, 2, 3, 6, P, P, P, P], [4, 5, 8, 9, 10, P, P, P]]))
    assert torch.equal(batch.labels, torch.tensor([[2, 3, 6, 7, P, P, P, P], [5, 8, 9, 10, 11, P, P, P]]))
    assert torch.equal(batch.loss_mask, torch.tensor([[0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]], dtype=F32))
    assert torch.equal(batch.position_ids, torch.arange(8)[None].expand(2, 8))
    ex = batch.extras
    assert torch.equal(ex["advantages"], torch.tensor([[0, 0, 0.5, 0.5, 0, 0, 0, 0], [0, -1.5, -1.5, -1.5, -1.5, 0, 0, 0]]))
    torch.testing.assert_close(ex["rollout_logprobs"], torch.tensor(
        [[0, 0, -0.1, -0.2, 0, 0, 0, 0], [0, -0.3, -0.4, -0.5, -0.6, 0, 0, 0]]), rtol=0, atol=0)
    assert torch.equal(ex["finished"], torch.tensor([[0, 0, 1, 1, 0, 0, 0, 0], [0] * 8], dtype=F32))
    # every masked label is a completion token, in order
    for i, comp in enumerate([[6, 7], [8, 9, 10, 11]]):
        assert batch.labels[i][batch.loss_mask[i].bool()].tolist() == comp


def test_pack_sequences_padding_multiple_of_8_and_cap():
    # 4 + 6 tokens -> 9 positions -> padded to 16
    kw = dict(prompts=[[1, 2, 3, 4]], completions=[[5, 6, 7, 8, 9, 10]],
              rollout_logprobs=[[-1.0] * 6], advantages=[1.0], finished=[True])
    b = _pack(**kw)
    assert b.tokens.shape == (1, 16)
    assert b.loss_mask.sum().item() == 6 and b.loss_mask[0, 3:9].sum().item() == 6
    # exactly 8 positions -> 8 (no extra block)
    b8 = _pack(prompts=[[1, 2, 3]], completions=[[4, 5, 6, 7, 8, 9]], rollout_logprobs=[[-1.0] * 6],
               advantages=[1.0], finished=[True])
    assert b8.tokens.shape == (1, 8)
    # the multiple of 8 is capped by the model context: 9 positions with max_length 12 -> 12
    b12 = _pack(max_length=12, **kw)
    assert b12.tokens.shape == (1, 12)
    # an empty completion leaves the row as padding with an empty mask
    be = _pack(prompts=[[1, 2], [3, 4]], completions=[[5], []], rollout_logprobs=[[-0.5], []],
               advantages=[1.0, 2.0], finished=[True, False])
    assert be.loss_mask[1].sum().item() == 0 and bool((be.tokens[1] == 99).all())
    assert be.loss_mask[0].tolist()[:2] == [0.0, 1.0]


def test_pack_sequences_errors():
    # 4 + 6 tokens = 9 positions > max_length 8
    with pytest.raises(ValueError, match="exceeds the model context"):
        _pack(prompts=[[1, 2, 3, 4]], completions=[[5, 6, 7, 8, 9, 10]], rollout_logprobs=[[-1.0] * 6],
              advantages=[1.0], finished=[True], max_length=8)
    with pytest.raises(ValueError, match="equal lengths"):
        _pack(advantages=[0.5])
    with pytest.raises(ValueError, match="equal lengths"):
        _pack(finished=[True, False, True])
    with pytest.raises(ValueError, match="equal lengths"):
        _pack(rollout_logprobs=[[-0.1, -0.2]])
    with pytest.raises(ValueError, match="log-probs"):
        _pack(rollout_logprobs=[[-0.1, -0.2], [-0.3]])


def test_split_microbatches():
    n, s = 5, 8
    batch = Batch(
        tokens=torch.arange(n * s).view(n, s), labels=torch.arange(n * s).view(n, s) + 1,
        loss_mask=torch.rand(n, s), position_ids=torch.arange(s)[None].expand(n, s).contiguous(),
        extras={"advantages": torch.arange(n, dtype=F32)[:, None].expand(n, s), "finished": torch.ones(n, s)},
    )
    parts = split_microbatches(batch, 2)
    assert [p.tokens.shape[0] for p in parts] == [2, 2, 1]
    for field in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(batch, field))
    for key in ("advantages", "finished"):
        assert torch.equal(torch.cat([p.extras[key] for p in parts]), batch.extras[key])
    assert parts[1].tokens[0, 0].item() == 2 * s  # rows 2 and 3, in order
    assert len(split_microbatches(batch, 16)) == 1 and split_microbatches(batch, 5)[0].tokens.shape[0] == 5


def test_pack_sequences_empty_prompt_is_a_clear_error():
    with pytest.raises(ValueError, match="prompt"):
        _pack(prompts=[[]], completions=[[5, 6, 7]], rollout_logprobs=[[-1.0, -2.0, -3.0]],
              advantages=[1.0], finished=[True])
    with pytest.raises(ValueError, match="prompt"):
        _pack(prompts=[[]], completions=[[5]], rollout_logprobs=[[-1.0]], advantages=[1.0], finished=[True])

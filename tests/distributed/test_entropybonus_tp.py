"""The RL loss with an entropy bonus (``rl.loss.entropy_coef > 0``) at TP=2 equals the TP=1 loss.

Two gloo ranks (torchrun) each hold one half of the vocabulary columns of the same logits and run the RL
step's loss function (``make_rl_loss_fn``: chunked vocabulary-parallel log-probs and entropy, TIS or PPO, the
bonus) over the TP group, then backpropagate it. Each rank also runs the same loss at TP=1 on the whole logits
(``tp_group=None``). Rank 0 gathers both gradient halves and compares the entropy, the loss and the logits'
gradient with the TP=1 run and with the dense float64 reference (``log_softmax`` on the full logits); each rank
checks that both ranks got identical values. A run without the bonus shows the bonus's gradient is not zero.

This file is also the worker: ``python -m torch.distributed.run --nproc-per-node 2
tests/distributed/test_entropybonus_tp.py OUT.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

CASES = [  # (dtype, tau, chunk, vocab incl. padding, padded columns, loss kind, entropy_coef)
    ("float32", 0.7, 5, 40, 0, "tis", 0.05),
    ("float32", 1.0, 0, 38, 6, "ppo", 0.2),
    ("bfloat16", 1.3, 3, 42, 4, "tis", 0.1),
]


def _loss_and_grad(z_local: torch.Tensor, batch, cfg, tau: float, group):
    from megatron_logra.rl.objective import make_rl_loss_fn

    z = z_local.clone().requires_grad_(True)
    loss, _, report = make_rl_loss_fn(cfg, tau, group)(batch, z)
    loss.backward()
    return loss.detach(), z.grad, report["entropy"][0]


def _case(dtype_name: str, tau: float, chunk: int, vocab: int, padded: int, kind: str, coef: float,
          rank: int, world: int, group) -> dict:
    from megatron_logra.rl.losses import LossConfig, ppo_clip_loss, tis_pg_loss
    from megatron_logra.train.step import Batch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(vocab + chunk)
    b, s = 3, 7
    z = torch.randn(b, s, vocab, generator=gen) * 3.0
    if padded:
        z[..., vocab - padded:] = -1.0e4  # models.gpt.mask_padded_vocab
    z = z.to(dtype)
    labels = torch.randint(0, vocab - padded, (b, s), generator=gen)
    labels[0, :4] = torch.tensor([0, vocab // 2 - 1, vocab // 2, vocab - padded - 1])  # both shards' edges
    mask = (torch.rand(b, s, generator=gen) < 0.7).float()
    rollout, adv = -torch.rand(b, s, generator=gen) * 3.0, torch.randn(b, s, generator=gen)
    batch = Batch(tokens=torch.zeros(b, s, dtype=torch.long), labels=labels, loss_mask=mask,
                  position_ids=torch.arange(s)[None].expand(b, s),
                  extras={"advantages": adv, "rollout_logprobs": rollout, "finished": torch.ones(b, s)})
    cfg = LossConfig(kind=kind, entropy_coef=coef, logprob_chunk_tokens=chunk)
    local = vocab // world
    z_local = z[..., rank * local:(rank + 1) * local]
    loss, grad_local, ent = _loss_and_grad(z_local, batch, cfg, tau, group)
    grads = [torch.empty_like(grad_local) for _ in range(world)]
    torch.distributed.all_gather(grads, grad_local.contiguous(), group=group)
    grad = torch.cat(grads, dim=-1)
    others = [torch.empty(2) for _ in range(world)]
    torch.distributed.all_gather(others, torch.stack([loss.float(), ent.float()]), group=group)
    same = all(torch.equal(o, others[0]) for o in others)

    loss1, grad1, ent1 = _loss_and_grad(z, batch, cfg, tau, None)  # TP 1: the whole vocabulary
    _, grad0, _ = _loss_and_grad(z, batch, LossConfig(kind=kind, logprob_chunk_tokens=chunk), tau, None)

    zr = z.double().requires_grad_(True)
    logq = torch.log_softmax(zr / tau, dim=-1)
    logp = logq.gather(-1, labels[..., None])[..., 0]
    pg = tis_pg_loss(logp, rollout.double(), adv.double(), mask.double(), cfg.tis_cap) if kind == "tis" else \
        ppo_clip_loss(logp, rollout.double(), adv.double(), mask.double(), cfg.clip_low, cfg.clip_high)
    ref_ent = (-(logq.exp() * logq).sum(-1) * mask.double()).sum()
    ref_loss = pg - coef * ref_ent
    (ref_grad,) = torch.autograd.grad(ref_loss, zr)
    return {
        "case": [dtype_name, tau, chunk, vocab, padded, kind, coef],
        "same_on_ranks": same,
        "entropy_vs_tp1": abs(ent.item() - ent1.item()),
        "entropy_err": abs(ent.item() - ref_ent.item()),
        "entropy_sum": ref_ent.item(),
        "loss_vs_tp1": abs(loss.item() - loss1.item()),
        "loss_err": abs(loss.item() - ref_loss.item()),
        "grad_vs_tp1": (grad.double() - grad1.double()).abs().max().item(),
        "grad_err": (grad.double() - ref_grad.to(dtype).double()).abs().max().item(),
        "grad_scale": ref_grad.abs().max().item(),
        "bonus_grad": (grad1.double() - grad0.double()).abs().max().item(),
        "grad_dtype": str(grad.dtype),
        "padded_grad_max": grad[..., vocab - padded:].abs().max().item() if padded else 0.0,
    }


def worker(out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package
    from support.case_worker import run_cases

    run_cases(_case, CASES, out)


def test_tp2_entropy_bonus_matches_tp1(launcher, tmp_path):
    out = tmp_path / "entropybonus_tp.json"
    launcher.launch(2, [str(Path(__file__).resolve()), str(out)], timeout=180, log=tmp_path / "launch.log")
    results = json.loads(out.read_text())
    assert len(results) == len(CASES)
    for r in results:
        bf16 = r["case"][0] == "bfloat16"
        # a bf16 gradient is one bf16 rounding of the fp32 one: within 2^-8 relative of the largest entry
        grad_tol = r["grad_scale"] * 2 ** -8 if bf16 else 1e-5
        assert r["same_on_ranks"], r
        assert r["entropy_vs_tp1"] < 1e-4 and r["entropy_err"] < 1e-4 * max(1.0, r["entropy_sum"]), r
        assert r["loss_vs_tp1"] < 1e-4 and r["loss_err"] < 1e-4, r
        assert r["grad_vs_tp1"] <= grad_tol and r["grad_err"] <= grad_tol, r
        assert r["bonus_grad"] > 10 * grad_tol, r  # the bonus changes the gradient by more than the tolerance
        assert r["grad_dtype"] == ("torch.bfloat16" if bf16 else "torch.float32"), r
        assert r["padded_grad_max"] == 0.0, r


if __name__ == "__main__":
    worker(sys.argv[1])

"""Vocabulary-parallel chunked log-probs / entropy at TP=2 equal the unsplit dense reference.

Two gloo ranks (torchrun) each hold one half of the vocabulary columns of the same logits, run
``chunked_logprobs_and_entropy`` over the TP group (labels on both halves, temperature ≠ 1, odd
chunk sizes, fp32 and bf16, padded columns at -1e4 on the last shard) and backpropagate the same
upstream gradients. Rank 0 gathers both gradient halves and compares values and gradients with
``log_softmax`` on the full logits; each rank also checks that both ranks got identical values.

This file is also the worker: ``python -m torch.distributed.run --nproc-per-node 2
tests/distributed/test_logprobs_tp.py OUT.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

CASES = [  # (dtype, tau, chunk, vocab incl. padding, padded columns)
    ("float32", 0.7, 5, 40, 0),
    ("float32", 1.0, 0, 38, 0),
    ("bfloat16", 1.3, 3, 42, 4),
    ("float32", 0.9, 1, 34, 6),
]


def _case(dtype_name: str, tau: float, chunk: int, vocab: int, padded: int, rank: int, world: int, group) -> dict:
    from megatron_logra.rl.logprobs import chunked_logprobs_and_entropy

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(vocab + chunk)
    b, s = 3, 7
    z = (torch.randn(b, s, vocab, generator=gen) * 3.0)
    if padded:
        z[..., vocab - padded:] = -1.0e4  # models.gpt.mask_padded_vocab
    z = z.to(dtype)
    labels = torch.randint(0, vocab - padded, (b, s), generator=gen)
    labels[0, :4] = torch.tensor([0, vocab // 2 - 1, vocab // 2, vocab - padded - 1])  # both shards' edges
    c_logp, c_ent = torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen)
    local = vocab // world
    z_local = z[..., rank * local:(rank + 1) * local].clone().requires_grad_(True)
    logp, ent = chunked_logprobs_and_entropy(z_local, labels, tau, group, chunk)
    (logp * c_logp + ent * c_ent).sum().backward()
    grads = [torch.empty_like(z_local.grad) for _ in range(world)]
    torch.distributed.all_gather(grads, z_local.grad.contiguous(), group=group)
    others = [torch.empty_like(logp) for _ in range(world)]
    torch.distributed.all_gather(others, logp.detach(), group=group)
    same = all(torch.equal(o, logp.detach()) for o in others)

    zr = z.clone().requires_grad_(True)
    logq = torch.log_softmax(zr.double() / tau, dim=-1)
    ref_logp = logq.gather(-1, labels[..., None])[..., 0]
    ref_ent = -(logq.exp() * logq).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref_logp * c_logp.double() + ref_ent * c_ent.double()).sum(), zr)
    grad = torch.cat(grads, dim=-1)
    return {
        "case": [dtype_name, tau, chunk, vocab, padded],
        "same_on_ranks": same,
        "logp_err": (logp.double() - ref_logp).abs().max().item(),
        "entropy_err": (ent.double() - ref_ent.detach()).abs().max().item(),
        "grad_err": (grad.double() - ref_grad.to(dtype).double()).abs().max().item(),
        "grad_scale": ref_grad.abs().max().item(),
        "grad_dtype": str(grad.dtype),
        "padded_grad_max": grad[..., vocab - padded:].abs().max().item() if padded else 0.0,
    }


def worker(out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package
    from support.case_worker import run_cases

    run_cases(_case, CASES, out)


def test_tp2_matches_unsplit(launcher, tmp_path):
    out = tmp_path / "logprobs_tp.json"
    launcher.launch(2, [str(Path(__file__).resolve()), str(out)], timeout=180, log=tmp_path / "launch.log")
    results = json.loads(out.read_text())
    assert len(results) == len(CASES)
    for r in results:
        bf16 = r["case"][0] == "bfloat16"
        assert r["same_on_ranks"], r
        assert r["logp_err"] < 2e-5 and r["entropy_err"] < 2e-5, r
        # a bf16 gradient is one bf16 rounding of the fp32 one: within 2^-8 relative of the largest entry
        assert r["grad_err"] <= (r["grad_scale"] * 2 ** -8 if bf16 else 1e-5), r
        assert r["grad_dtype"] == ("torch.bfloat16" if bf16 else "torch.float32"), r
        assert r["padded_grad_max"] == 0.0, r


if __name__ == "__main__":
    worker(sys.argv[1])

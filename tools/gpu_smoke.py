"""GPU smoke test: a few LoGRA and dense-AdamW steps of a small GPT on one GPU.

    python tools/gpu_smoke.py [--hidden 2048 --layers 8 --rank 128 --steps 5]

Prints peak allocated memory and median step time of each, and their ratio. Runs in
about a minute on one modern GPU (no TransformerEngine needed: megatron-core local specs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def run(kind: str, args) -> tuple[float, float, float]:
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.train.step import Batch, forward_backward

    groups = initialize_parallel(ParallelConfig(), seed=1)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 128,
                      ffn_hidden_size=args.hidden * 4, vocab_size=32000, seq_length=args.seq, params_dtype="bfloat16")
    model = build_gpt(cfg, groups, seed=1).cuda()
    opt_cfg = OptimizerConfig(name="adam" if kind == "adam" else "logra",
                              logra=LograConfig(rank=args.rank, masters="fp32" if kind == "logra-fp32" else "none"),
                              native=NativeConfig(lr=1e-4))
    opt = build_optimizer(model, opt_cfg, groups)
    tokens = torch.randint(0, 32000, (args.mbs, args.seq), device="cuda")
    batch = Batch(tokens=tokens, labels=tokens, loss_mask=torch.ones_like(tokens, dtype=torch.float32),
                  position_ids=torch.arange(args.seq, device="cuda")[None].expand(args.mbs, -1))
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        res = forward_backward(model, [batch], groups)
        opt.apply(opt.prepare(num_tokens=res.num_tokens))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(res.loss)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    destroy_parallel()
    torch.cuda.empty_cache()
    return peak, statistics.median(times[1:]), losses[-1]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do", file=sys.stderr)
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    results = {k: run(k, args) for k in ("adam", "logra-fp32", "logra-bf16")}
    base_mem, base_t, _ = results["adam"]
    print(f"{'optimizer':12s} {'peak GiB':>9s} {'x dense':>8s} {'step s':>8s} {'x dense':>8s} {'loss':>8s}")
    for k, (mem, t, loss) in results.items():
        print(f"{k:12s} {mem:9.2f} {mem / base_mem:8.2f} {t:8.3f} {t / base_t:8.2f} {loss:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

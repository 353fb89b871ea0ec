"""GPU smoke test: a few LoGRA and dense-AdamW steps of a small GPT on one GPU, plus TE / FP8 checks.

    python tools/gpu_smoke.py                         # TE spec when installed (auto), else local
    python tools/gpu_smoke.py --impl local --hidden 2048 --layers 8 --rank 128 --steps 5
    python tools/gpu_smoke.py --fp8 hybrid            # FP8 training GEMMs (TE, compute capability >= 8.9)

Sections (each prints one table):

1. steps: dense AdamW, LoGRA with fp32 masters, LoGRA bf16-only on the same model and batch: peak
   allocated memory and median step time, and their ratios to dense AdamW.
2. TE capture (TransformerEngine installed): sketches of a TE-spec GPT (fused
   ``TELayerNormColumnParallelLinear`` for QKV / fc1, ``TERowParallelLinear`` for proj / fc2) equal
   ``G·Aᵀ`` of an unfrozen twin's dense gradient: the largest relative error per target kind.
3. FP8 (compute capability >= 8.9): the FP8 projection error (``X·Aᵀ`` with exact Rademacher signs
   in E4M3, ``torch._scaled_mm``, no TE needed) vs fp64; with TE also LoGRA step time with
   ``model.fp8=hybrid`` vs bf16 on the TE spec.

Default sizes finish in well under five minutes on one H100. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from megatron_logra.argtypes import positive_int

RANK_SEED = 5


def _model_cfg(args, **over):
    from megatron_logra.models.gpt import ModelConfig

    kw = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 128,
              ffn_hidden_size=args.hidden * 4, vocab_size=32000, seq_length=args.seq, params_dtype="bfloat16",
              transformer_impl=args.impl)
    kw.update(over)
    return ModelConfig(**kw)


def run_steps(kind: str, args, **model_over) -> tuple[float, float, float]:
    """(peak GiB, median step s, last loss) of ``args.steps`` optimizer steps."""
    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.train.step import Batch, forward_backward

    groups = initialize_parallel(ParallelConfig(), seed=1)
    model = build_gpt(_model_cfg(args, **model_over), groups, seed=1).cuda()
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
    return peak, statistics.median(times[1:] or times), losses[-1]


def _table(results: dict, base: str) -> None:
    base_mem, base_t, _ = results[base]
    print(f"{'run':22s} {'peak GiB':>9s} {'x ' + base:>12s} {'step s':>8s} {'x ' + base:>12s} {'loss':>8s}")
    for k, (mem, t, loss) in results.items():
        print(f"{k:22s} {mem:9.2f} {mem / base_mem:12.2f} {t:8.3f} {t / base_t:12.2f} {loss:8.3f}")


def te_capture_check(args) -> bool:
    """Sketch == G·Aᵀ on a small TE-spec GPT (fp32 parameters); prints the worst error per kind."""
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.sketch.capture import install_sketches
    from megatron_logra.sketch.random_projection import projection

    groups = initialize_parallel(ParallelConfig(), seed=1)
    cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=2, ffn_hidden_size=512, vocab_size=1024,
                      seq_length=128, transformer_impl="transformer_engine")
    model, dense = build_gpt(cfg, groups, seed=3), build_gpt(cfg, groups, seed=3)
    ss = install_sketches(model, rank=32, seed=RANK_SEED, tp_group=groups.tp)
    tokens = torch.randint(0, 1024, (2, 128), device="cuda")
    pos = torch.arange(128, device="cuda")[None].expand(2, -1)
    for net in (model, dense):
        net(tokens, pos, None, labels=tokens).float().sum().backward()
    worst: dict[str, float] = {}
    for t in ss.targets:
        grad = dense.get_submodule(t.module_name).weight.grad.double()
        ref = grad @ projection(RANK_SEED, t.name, 0, 32, t.n_in, device="cuda").double().T
        err = float((t.sketch.double() - ref).abs().max() / ref.abs().max())
        key = f"{t.kind} ({type(t.module).__name__}{', norm(x)' if t.fused_norm else ''})"
        worst[key] = max(worst.get(key, 0.0), err)
    destroy_parallel()
    ok = all(e < 5e-3 for e in worst.values())
    print("\nTE capture: sketch vs dense G·Aᵀ (max relative error, fp32 params, TF32 GEMMs allowed)")
    for k, e in worst.items():
        print(f"  {k:60s} {e:.2e}")
    print(f"  {'PASS' if ok else 'FAIL'} (tolerance 5e-3)")
    return ok


def fp8_projection_check(args) -> bool:
    """The FP8 projection ``X·Aᵀ`` (``torch._scaled_mm``; no TE needed) against fp64."""
    from megatron_logra.sketch.fp8 import fp8_projection_error
    from megatron_logra.sketch.random_projection import projection

    x = torch.randn(args.mbs * args.seq, args.hidden, device="cuda")
    x[:, :8] *= 20  # a few outlier channels, as in LLM activations
    e = fp8_projection_error(x, projection(RANK_SEED, "model.layers.0.mlp.up_proj", 0, args.rank, args.hidden,
                                           device="cuda"))
    print("\nFP8 projection X·Aᵀ (relative Frobenius error vs fp64):")
    for k, v in e.items():
        print(f"  {k:18s} {v:.3e}")
    ok = (e["sign_exact"] == 1.0 and e["projection_added"] < 0.01 * e["x_quantization"]
          and e["fp8_vs_fp32"] <= 1.1 * e["x_quantization"] + 1e-6)
    print(f"  {'PASS' if ok else 'FAIL'}: Rademacher signs exact in E4M3; the GEMM adds < 1% of X's rounding error")
    return ok


def fp8_training_table(args) -> None:
    """LoGRA step time and memory with FP8 training GEMMs (TE spec) vs bf16."""
    results = {"logra-fp32 bf16 (TE)": run_steps("logra-fp32", args, transformer_impl="transformer_engine"),
               f"logra-fp32 fp8={args.fp8 or 'hybrid'}": run_steps(
                   "logra-fp32", args, transformer_impl="transformer_engine", fp8=args.fp8 or "hybrid")}
    print("\nFP8 training GEMMs (TE spec, LoGRA fp32 masters):")
    _table(results, "logra-fp32 bf16 (TE)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=positive_int, default=2048, help="a multiple of 128 (heads of dimension 128)")
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--rank", type=positive_int, default=128)
    p.add_argument("--seq", type=positive_int, default=1024)
    p.add_argument("--mbs", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=5)
    p.add_argument("--impl", choices=["auto", "local", "transformer_engine"], default="auto")
    p.add_argument("--fp8", choices=["hybrid", "e4m3"], default=None, help="FP8 format of the FP8 section")
    args = p.parse_args(argv)
    if args.hidden % 128:
        p.error(f"argument --hidden: {args.hidden} is not a multiple of 128 (the model has hidden // 128 attention "
                "heads of dimension 128)")
    if args.rank % 16:  # the FP8 sections need it (torch._scaled_mm): refused here, not after the steps section
        p.error(f"argument --rank: {args.rank} is not a multiple of 16 (the FP8 projection's torch._scaled_mm "
                f"needs it; e.g. {max(16, args.rank - args.rank % 16)})")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do", file=sys.stderr)
        return 0
    from megatron_logra.models.te import resolve_transformer_impl, te_unavailable_reason

    t_start = time.perf_counter()
    impl = resolve_transformer_impl(args.impl)
    print(f"device: {torch.cuda.get_device_name()}, spec: {impl}, torch {torch.__version__}")
    results = {k: run_steps(k, args) for k in ("adam", "logra-fp32", "logra-bf16")}
    print(f"\nsteps ({impl} spec, hidden {args.hidden}, {args.layers} layers, {args.mbs}x{args.seq} tokens, "
          f"rank {args.rank}):")
    _table(results, "adam")
    ok = True
    fp8_capable = torch.cuda.get_device_capability() >= (8, 9)
    if fp8_capable:
        ok &= fp8_projection_check(args)
    else:
        print("\nFP8 checks skipped: compute capability < 8.9")
    reason = te_unavailable_reason()
    if reason:
        print(f"\nTE checks (capture, FP8 training GEMMs) skipped: {reason}")
    else:
        ok &= te_capture_check(args)
        if fp8_capable:
            fp8_training_table(args)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

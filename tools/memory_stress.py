#!/usr/bin/env python
"""Memory stress: N real LoGRA and dense-AdamW training steps at a given scale; per-step peaks as CSV + PNG.

    python tools/memory_stress.py --hidden 2048 --layers 8 --micro-batch 2 --seq-len 2048 --steps 5
    torchrun --nproc-per-node 8 tools/memory_stress.py --model 27b --tp 8 --rank 128 --recompute full --steps 3
    python tools/memory_stress.py --model 27b --tp 8 --dry-run          # planner prediction only (meta device)
    python tools/memory_stress.py --device cpu --hidden 64 --layers 2 --rank 8 --steps 2 --out /tmp/stress

Per optimizer (``--optimizers logra,adam``, one after another in this process): build the GPT,
run ``--steps`` full steps (forward/backward of the RL loss on chunked vocabulary-parallel
log-probs, or megatron's LM loss with ``--loss lm``; ``prepare``; ``apply``) and record per step,
as the maximum over ranks:

* CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (reset every step) and, with
  nvidia-ml-py and the NVML library, the device's used memory sampled every 5 ms (whole device);
* CPU: the peak of live tensor bytes (:class:`megatron_logra.memory.measure.LiveTensorTracker`)
  and the process's peak RSS (imports included; reset through ``/proc/self/clear_refs``);
* optimizer-state bytes counted from the objects (fp32 grads, masters, Adam moments; LoGRA: sketch
  buffer, row moments, target masters and its native AdamW's state).

Beside them: the memory planner's prediction (``megatron_logra.memory``, counts from the model on
the meta device; no distributed optimizer, engine or CUDA overhead): trainer peak and optimizer
state. ``--dry-run`` builds and runs nothing: the table and the files hold the prediction only. Rank 0
writes ``OUT/memory_stress.{csv,png}`` (``--out``, default ``runs/memory_stress``).
"""

from __future__ import annotations

import argparse
import csv
import gc
import logging
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from optimizer_memory import ffn_size  # noqa: E402

from megatron_logra.bench.outputs import why_unwritable  # noqa: E402
from megatron_logra.memory.measure import LiveTensorTracker  # noqa: E402
from megatron_logra.memory.measure import maxrss_bytes as _maxrss_bytes  # noqa: E402
from megatron_logra.memory.measure import reset_peak_rss as _reset_peak_rss  # noqa: E402
from megatron_logra.plot import pyplot, save_figure  # noqa: E402

logger = logging.getLogger("memory_stress")

COLUMNS = ["optimizer", "step", "device", "world", "tp", "tokens_per_step", "peak_allocated_bytes",
           "peak_reserved_bytes", "nvml_peak_used_bytes", "live_tensor_peak_bytes", "peak_rss_bytes",
           "optimizer_state_bytes", "predicted_peak_bytes", "predicted_optimizer_state_bytes", "step_seconds", "loss"]
MEASURED = COLUMNS[6:12] + ["step_seconds"]
GiB = 2 ** 30


def model_config(args):
    from megatron_logra.models.gpt import ModelConfig
    from megatron_logra.models.presets import resolve_model

    if args.model:
        return resolve_model(args.model, seq_length=args.seq_len)
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads or max(1, args.hidden // 64),
                       num_query_groups=args.query_groups, ffn_hidden_size=args.ffn or ffn_size(args.hidden),
                       vocab_size=args.vocab, seq_length=args.seq_len, params_dtype=args.dtype, swiglu=True)


def predicted(mcfg, kind: str, args, world: int) -> tuple[int, int]:
    """(trainer peak, optimizer state) bytes of one rank from the memory planner."""
    from megatron_logra.memory import PlanConfig, plan
    from megatron_logra.memory.preflight import attention_kernel

    # the tool applies every step at α = 1 (no KL controller): LoGRA's native AdamW step copies no masters
    p = plan(mcfg, PlanConfig(tp=args.tp, dp=max(1, world // args.tp), optimizer=kind, rank=args.rank,
                              masters=args.masters, micro_batch=args.micro_batch, seq_len=args.seq_len,
                              recompute=args.recompute, distributed_optimizer=False, overhead_bytes=0,
                              logprob_chunk_tokens=args.chunk_tokens, loss="lm" if args.loss == "lm" else "logprob",
                              policy_sync=False, attention=attention_kernel(mcfg), scaled_native_step=False))
    w = p.worst
    return w.trainer_peak, w.grads + w.masters + w.moments + w.sketches + w.row_moments


def optimizer_state_bytes(opt) -> int:
    """Bytes of the unique storages the optimizer keeps across steps (weights excluded)."""
    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()

    native = opt.native
    for p, m in zip(native.params, native.masters):
        add(p.grad)
        add(getattr(p, "main_grad", None))
        if m is not p:
            add(m)
    if native.inner is not None:
        for state in native.inner.state.values():
            for v in state.values():
                add(v)
    if hasattr(opt, "sketches"):
        add(opt.sketches.flat)
        for v in list(opt.row_moments.values()) + list(opt.masters.values()):
            add(v)
    return total


class NvmlSampler:
    """Peak device memory in use during a region, sampled every ``interval`` s (None without NVML)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.handle, self.interval, self.peak = None, interval, None
        try:
            import pynvml
        except ImportError:
            logger.warning("nvidia-ml-py (pynvml) is not installed: no NVML readings (pip install nvidia-ml-py)")
            return
        try:
            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            try:  # by PCI id: CUDA_VISIBLE_DEVICES renumbers CUDA devices, not NVML's
                pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci.encode())
            except (AttributeError, pynvml.NVMLError):
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self._info = pynvml.nvmlDeviceGetMemoryInfo
        except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound without a driver, and friends
            logger.warning("NVML unavailable (%s): no NVML readings", exc)
            self.handle = None

    def __enter__(self):
        self.peak, self._stop = None, threading.Event()
        if self.handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            used = self._info(self.handle).used
            self.peak = used if self.peak is None else max(self.peak, used)
            if self._stop.wait(self.interval):
                return

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self._stop.set()
            self._thread.join()


def make_batch(mcfg, args, device, seed: int):
    from megatron_logra.train.step import Batch

    gen = torch.Generator().manual_seed(seed)
    b, s = args.micro_batch, args.seq_len
    tokens = torch.randint(0, mcfg.vocab_size, (b, s), generator=gen)
    mask = torch.ones(b, s)
    mask[:, : s // 4] = 0.0  # a prompt part outside the loss
    extras = {"advantages": torch.randn(b, 1, generator=gen).expand(b, s).contiguous(),
              "rollout_logprobs": torch.full((b, s), -2.0), "finished": torch.ones(b, s)}
    return Batch(tokens.to(device), torch.roll(tokens, -1, dims=1).to(device), mask.to(device),
                 torch.arange(s)[None].expand(b, s).contiguous().to(device), {k: v.to(device) for k, v in extras.items()})


def run_kind(kind: str, mcfg, args, device: torch.device, world: int, groups) -> list[dict]:
    """Steps of one optimizer ``kind`` on ``groups`` (made once for every kind: megatron's teardown keeps the
    process groups, so making them again per kind would leave the earlier NCCL communicators' buffers in the
    next kind's memory peak)."""
    import torch.distributed as dist

    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.rl.loop import make_rl_loss_fn
    from megatron_logra.rl.losses import LossConfig
    from megatron_logra.train.step import forward_backward

    model = build_gpt(mcfg, groups, seed=1)
    if device.type == "cuda":
        model = model.cuda()
    ocfg = OptimizerConfig(name="adam" if kind == "adam" else "logra", native=NativeConfig(lr=1e-5),
                           logra=LograConfig(rank=args.rank, masters=args.masters, lr=1e-5))
    opt = build_optimizer(model, ocfg, groups)
    loss_fn = make_rl_loss_fn(LossConfig(logprob_chunk_tokens=args.chunk_tokens), 1.0, groups.tp) \
        if args.loss == "rl" else None
    pred_peak, pred_state = predicted(mcfg, kind, args, world)
    cuda = device.type == "cuda"
    nvml = NvmlSampler() if cuda else None
    rows = []
    for step in range(1, args.steps + 1):
        batches = [make_batch(mcfg, args, device, 1000 * step + i) for i in range(args.micro_batches)]
        gc.collect()
        tracker = LiveTensorTracker() if (not cuda and args.track_tensors) else None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()
        t0 = time.perf_counter()
        with nvml or nullcontext(), tracker or nullcontext():
            opt.zero_grad()
            res = forward_backward(model, batches, groups, loss_fn=loss_fn)
            opt.apply(opt.prepare(num_tokens=res.num_tokens))
            if cuda:
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        vals = {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "nvml_peak_used_bytes": nvml.peak if nvml is not None else None,
            "live_tensor_peak_bytes": tracker.peak if tracker is not None else None,
            "peak_rss_bytes": None if cuda else _maxrss_bytes(),
            "optimizer_state_bytes": optimizer_state_bytes(opt),
            "step_seconds": seconds,
        }
        # worst rank: the maximum of each reading over the world (-1 = not measured)
        t = torch.tensor([float(-1 if vals[k] is None else vals[k]) for k in MEASURED], dtype=torch.float64,
                         device=device)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        vals = {k: (None if v < 0 else (v if k == "step_seconds" else int(v))) for k, v in zip(MEASURED, t.tolist())}
        rows.append({"optimizer": kind, "step": step, "device": device.type, "world": world, "tp": args.tp,
                     "tokens_per_step": args.micro_batch * args.seq_len * args.micro_batches * max(1, world // args.tp),
                     **vals, "predicted_peak_bytes": pred_peak, "predicted_optimizer_state_bytes": pred_state,
                     "loss": res.loss})
        logger.info("%s step %d: %s", kind, step, {k: v for k, v in vals.items() if v is not None})
    del model, opt, loss_fn
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def unit_of(rows: list[dict]) -> tuple[str, int]:
    """GiB when any reading reaches 1 GiB, else MiB."""
    keys = [k for k in COLUMNS if k.endswith("_bytes")]
    big = max((r[k] for r in rows for k in keys if r.get(k) is not None), default=0)
    return ("GiB", GiB) if big >= GiB else ("MiB", 2 ** 20)


def fmt(v, scale: int) -> str:
    return "-" if v in (None, "") else f"{int(v) / scale:.3f}"


def report(rows: list[dict], out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "memory_stress.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})
    unit, scale = unit_of(rows)
    head = ["optimizer", "step", "allocated", "reserved", "NVML used", "live tensors", "RSS", "predicted peak",
            "opt state", "predicted opt state", "step s"]
    print(f"{title}\n(peaks per step, worst rank, {unit})")
    print(" | ".join(head))
    keys = ["peak_allocated_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "live_tensor_peak_bytes",
            "peak_rss_bytes", "predicted_peak_bytes", "optimizer_state_bytes", "predicted_optimizer_state_bytes"]
    for r in rows:
        print(" | ".join([r["optimizer"], str(r["step"]), *(fmt(r.get(k), scale) for k in keys),
                          "-" if r.get("step_seconds") is None else f"{r['step_seconds']:.2f}"]))
    plot(rows, out / "memory_stress.png", title)
    print(f"wrote {out / 'memory_stress.csv'} and {out / 'memory_stress.png'}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()

    unit, scale = unit_of(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_rss = None
    kinds = list(dict.fromkeys(r["optimizer"] for r in rows))
    series = (("peak_allocated_bytes", "-o", "allocated"), ("peak_reserved_bytes", "--s", "reserved"),
              ("nvml_peak_used_bytes", ":^", "NVML used"), ("live_tensor_peak_bytes", "-o", "live tensors"),
              ("peak_rss_bytes", ":s", "process RSS (right axis)"))
    for i, kind in enumerate(kinds):
        rs, colour = [r for r in rows if r["optimizer"] == kind], f"C{i}"
        for key, style, what in series:
            pts = [(r["step"], r[key] / scale) for r in rs if r.get(key) is not None]
            if pts:  # RSS is the whole process, imports included: its own axis
                ax = (ax_rss := ax_rss or ax1.twinx()) if key == "peak_rss_bytes" else ax1
                ax.plot(*zip(*pts), style, color=colour, label=f"{kind} {what}")
        ax1.axhline(rs[0]["predicted_peak_bytes"] / scale, color=colour, alpha=0.5, lw=1, label=f"{kind} predicted")
        ax2.bar(i - 0.2, (rs[-1].get("optimizer_state_bytes") or 0) / scale, 0.4, color=colour,
                label="measured" if i == 0 else None)
        ax2.bar(i + 0.2, rs[0]["predicted_optimizer_state_bytes"] / scale, 0.4, color=colour, alpha=0.4,
                hatch="//", label="predicted" if i == 0 else None)
    ax1.set(xlabel="step", ylabel=f"{unit} (worst rank)", title="peak memory per step", ylim=(0, None))
    ax1.xaxis.get_major_locator().set_params(integer=True)
    handles, labels = ax1.get_legend_handles_labels()
    if ax_rss is not None:
        ax_rss.set_ylabel(f"process RSS {unit}")
        handles, labels = handles + ax_rss.get_legend_handles_labels()[0], labels + ax_rss.get_legend_handles_labels()[1]
    ax1.legend(handles, labels, fontsize=7)
    ax2.set_xticks(range(len(kinds)), kinds)
    ax2.set(ylabel=f"{unit} (worst rank)", title="optimizer state")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memory_stress.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default=None, help="preset (qwen2.5-1.5b, qwen2.5-7b, 27b) or config.json; else the sizes below")
    for flag, default, what in (
            ("--hidden", 256, "hidden size (default 256)"), ("--layers", 2, "layers (default 2)"),
            ("--heads", None, "attention heads (default hidden // 64)"),
            ("--query-groups", None, "query groups (default: one per head)"),
            ("--ffn", None, "MLP width (default: optimizer_memory.py's ffn_size of --hidden)"),
            ("--vocab", 32000, "vocabulary (default 32000)"),
            ("--micro-batch", 1, "sequences per micro-batch (default 1)"),
            ("--micro-batches", 1, "micro-batches per step (default 1)"),
            ("--seq-len", 512, "tokens per sequence (default 512)"),
            ("--tp", 1, "tensor-parallel size; the world size under torchrun must be a multiple (default 1)"),
            ("--rank", 128, "LoGRA sketch rank (default 128)"),
            ("--chunk-tokens", 1024, "tokens per log-prob chunk of the RL loss, 0 = one chunk (default 1024)"),
            ("--steps", 3, "steps per optimizer (default 3)")):
        add(flag, type=int, default=default, help=what)
    add("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    add("--masters", choices=["fp32", "none"], default="fp32")
    add("--recompute", choices=["none", "full"], default="none")
    add("--loss", choices=["rl", "lm"], default="rl", help="RL loss (chunked log-probs) or megatron's LM loss")
    add("--optimizers", default="logra,adam", help="comma list of logra and/or adam, run in this order (default both)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto",
        help="auto: CUDA when available (default); cuda or cpu is refused when it is not the one present")
    add("--no-track-tensors", dest="track_tensors", action="store_false", help="CPU: RSS only (faster)")
    add("--dry-run", action="store_true",
        help="planner prediction only: nothing is built or run; the table and OUT/memory_stress.{csv,png} hold the "
             "prediction")
    add("--out", default="runs/memory_stress",
        help="directory of memory_stress.csv and memory_stress.png (default runs/memory_stress)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    kinds = [k.strip() for k in args.optimizers.split(",") if k.strip()]
    if not kinds or any(k not in ("logra", "adam") for k in kinds) or args.steps < 1:
        parser.error(f"--optimizers={args.optimizers!r} (logra and/or adam), --steps={args.steps} (>= 1)")
    for flag in ("micro_batch", "micro_batches", "seq_len", "tp", "rank", "layers", "hidden", "vocab",
                 "heads", "query_groups", "ffn"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:  # 0 would fall back to the default
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    problem = why_unwritable(args.out, directory=True)  # a file, or below one, or read-only: before anything runs
    if problem:
        parser.error(f"--out={args.out}: {problem}; give a directory (memory_stress.csv and .png are written there)")
    if args.chunk_tokens < 0:
        parser.error(f"--chunk-tokens={args.chunk_tokens} must be >= 0 (0 = unchunked)")
    try:
        mcfg = replace(model_config(args), recompute=args.recompute)
        for k in kinds:  # the planner's layout checks (TP divides the model, LoGRA rank <= every target's n_in)
            predicted(mcfg, k, args, args.tp)
    except ValueError as exc:
        parser.error(str(exc))
    title = (f"{args.model or f'hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}'}; micro-batch "
             f"{args.micro_batch} x seq {args.seq_len} x {args.micro_batches}, TP {args.tp}, LoGRA rank {args.rank} "
             f"({args.masters} masters), recompute {args.recompute}, loss {args.loss}")
    if args.dry_run:
        rows = [{"optimizer": k, "step": 0, "device": "meta", "world": args.tp, "tp": args.tp,
                 "tokens_per_step": args.micro_batch * args.seq_len * args.micro_batches,
                 **dict(zip(("predicted_peak_bytes", "predicted_optimizer_state_bytes"), predicted(mcfg, k, args, args.tp)))}
                for k in kinds]
        report(rows, Path(args.out), title + " (dry run: planner only)")
        return 0
    use_cuda = torch.cuda.is_available()
    if args.device != "auto" and use_cuda != (args.device == "cuda"):  # the CPU shim is active only without CUDA
        parser.error(f"--device {args.device}: CUDA is {'' if use_cuda else 'not '}available")
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, init_distributed, initialize_parallel

    init_distributed("nccl" if use_cuda else "gloo")
    import torch.distributed as dist

    world, rank0 = dist.get_world_size(), dist.get_rank() == 0
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    try:
        groups = initialize_parallel(ParallelConfig(tp=args.tp), seed=1)
        rows = [row for kind in kinds for row in run_kind(kind, mcfg, args, device, world, groups)]
    finally:
        destroy_parallel()
    if rank0:
        report(rows, Path(args.out), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training worker for the distributed equivalence tests.

Launch with torchrun (``python -m torch.distributed.run --nproc-per-node N worker.py ...``) or as
a plain 1-process ``python worker.py ...`` (a gloo world of size 1).

Each *job* builds a small megatron-core GPT at a (TP, PP) layout (DP = world / (TP·PP)), trains it
for a few steps on the synthetic reverse task with the same *global* batch at every layout
(micro-batch ``i`` of DP rank ``d`` is global micro-batch ``d·num_micro + i``), and records

* per step: the global loss, grad norm, clip coefficient, skipped flag;
* per step (LoGRA): every target's sketch right after ``prepare()`` — TP-reduced, DP-summed and
  divided by the global token count — gathered to the FULL layout under its canonical name
  (column-parallel sketches are row shards laid out like the weight and are unsharded with the
  weight as template; row-parallel sketches are already full after prepare's TP reduce);
* at the end: the full fp32 weights by global name (``gather_full_state``), gathered over PP;
* under PP: the outcome of installing stage-specific and missing sketch targets on every rank;
* bitwise agreement checks: max |difference| of every parameter between DP replicas, and of
  TP-replicated (non-sharded) parameters between TP ranks — both must be exactly 0.

Global rank 0 writes ``OUT/<job>.safetensors`` (keys ``init/<global name>`` and
``weight/<global name>``: full weights before and after training, ``sketch/<step>/<canonical name>``) and ``OUT/<job>.json``. Several jobs run one after another
in one launch (``--job NAME:key=value,...``), re-initialising the parallel groups for each;
this amortises torchrun's start-up cost (imports take most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_logra.data.synthetic import SyntheticConfig, SyntheticTask  # noqa: E402
from megatron_logra.models.gpt import ModelConfig, build_gpt  # noqa: E402
from megatron_logra.models.layout import gather_full_state, unshard  # noqa: E402
from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer  # noqa: E402
from megatron_logra.optim.logra import LograOptimizer  # noqa: E402
from megatron_logra.parallel import ParallelConfig, initialize_parallel  # noqa: E402
from megatron_logra.train.step import forward_backward  # noqa: E402

# key -> (type, default); every job setting, overridable per job
SETTINGS: dict[str, tuple[type, object]] = {
    "tp": (int, 1),
    "pp": (int, 1),
    "optimizer": (str, "logra"),
    "steps": (int, 3),
    "mbs": (int, 2),
    "gbs": (int, 8),
    "recompute": (str, "none"),
    "hidden_dropout": (float, 0.0),
    "dtype": (str, "float32"),
    "layers": (int, 4),
    "rank": (int, 8),
    "lr": (float, 1e-2),
    "clip_grad": (float, 1.0),
    "seed": (int, 1234),
    "tie": (int, 0),  # 1: tied word embeddings and output layer (untie_embeddings_and_output_weights=False)
}


def parse_args(argv=None) -> tuple[str, list[tuple[str, dict]]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, (typ, default) in SETTINGS.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=typ, default=default)
    p.add_argument("--name", default="run", help="job name when no --job is given")
    p.add_argument("--job", action="append", default=[],
                   help="NAME[:key=value,...]: a job with the flags above as defaults (repeatable)")
    p.add_argument("--out", required=True, help="output directory")
    ns = p.parse_args(argv)
    base = {k: getattr(ns, k) for k in SETTINGS}
    jobs = []
    for spec in ns.job or [ns.name]:
        name, _, rest = spec.partition(":")
        cfg = dict(base)
        for item in filter(None, rest.split(",")):
            key, _, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if key not in SETTINGS:
                p.error(f"job {name}: unknown setting {key!r}; known: {sorted(SETTINGS)}")
            cfg[key] = SETTINGS[key][0](raw)
        jobs.append((name, cfg))
    return ns.out, jobs


def _max_replica_diff(tensors: list[torch.Tensor], group) -> float:
    """max over tensors of (elementwise max − min) across the ranks of ``group``."""
    if group is None or dist.get_world_size(group) == 1 or not tensors:
        return 0.0
    flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float((hi - lo).max().item())


def _full_sketches(opt: LograOptimizer, groups) -> dict[str, torch.Tensor]:
    """Canonical name -> full-layout sketch (collective over the TP group)."""
    out = {}
    tp = groups.tp_size
    for t in opt.targets:
        s = t.sketch.detach().clone()
        if t.parallel == "column" and tp > 1:
            shards = [torch.empty_like(s) for _ in range(tp)]
            dist.all_gather(shards, s.contiguous(), group=groups.tp)
            s = unshard(shards, t.weight)
        assert t.name not in out, f"duplicate canonical target name {t.name}"
        out[t.name] = s
    return out


TARGET_CHECKS = ("output_layer", "linear_fc1,no_such_layer")
"""Target lists of :func:`_target_checks`: one on the last stage only, one that matches nowhere."""


def _target_checks(mcfg: ModelConfig, groups, seed: int) -> dict[str, list]:
    """PP > 1: a LoGRA optimizer (whose ``install_sketches`` agrees over the pipeline group) on a
    fresh model for each of :data:`TARGET_CHECKS`; per case, every rank's ``(pp_rank, outcome)``, the
    outcome being this stage's number of targets or the text of the ``ValueError`` (a rank that raised
    alone would hang its peers in the next collective, so a disagreement shows up as a timeout of the
    launch)."""
    out = {}
    for case in TARGET_CHECKS:
        model = build_gpt(mcfg, groups, seed=seed)
        try:
            opt = LograOptimizer(model, LograConfig(targets=case.split(","), rank=8, seed=seed),
                                 NativeConfig(freeze=True), groups)
            outcome = len(opt.sketches.targets)
            opt.sketches.remove()
        except ValueError as exc:
            outcome = str(exc)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (groups.pp_rank, outcome))
        out[case] = gathered
    return out


def run_job(name: str, cfg: dict, out_dir: str) -> None:
    t0 = time.perf_counter()
    groups = initialize_parallel(ParallelConfig(tp=cfg["tp"], pp=cfg["pp"]), seed=cfg["seed"])
    dp, dp_rank = groups.dp_size, groups.dp_rank
    if cfg["gbs"] % (cfg["mbs"] * dp):
        raise ValueError(f"job {name}: gbs={cfg['gbs']} is not a multiple of mbs × dp = {cfg['mbs']} × {dp}")
    num_micro = cfg["gbs"] // (cfg["mbs"] * dp)
    data = SyntheticConfig(task="reverse", content_length=6, num_symbols=12, seed=cfg["seed"])
    mcfg = ModelConfig(
        num_layers=cfg["layers"], hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=64,
        seq_length=32, swiglu=True, params_dtype=cfg["dtype"], recompute=cfg["recompute"],
        hidden_dropout=cfg["hidden_dropout"], untie_embeddings_and_output_weights=not cfg["tie"],
    )
    target_checks = _target_checks(mcfg, groups, cfg["seed"]) if groups.pp_size > 1 else None
    model = build_gpt(mcfg, groups, seed=cfg["seed"])
    ocfg = OptimizerConfig(
        name=cfg["optimizer"],
        logra=LograConfig(rank=cfg["rank"], lr=cfg["lr"], clip_grad=cfg["clip_grad"], seed=cfg["seed"]),
        native=NativeConfig(lr=cfg["lr"]),
    )
    opt = build_optimizer(model, ocfg, groups)
    task = SyntheticTask(data, mcfg.vocab_size)
    logra = isinstance(opt, LograOptimizer)

    record = {"name": name, "config": cfg, "tp": groups.tp_size, "pp": groups.pp_size, "dp": dp,
              "world": dist.get_world_size(), "num_micro": num_micro,
              "losses": [], "grad_norms": [], "clip_coefs": [], "skipped": [], "tokens": [],
              "target_checks": target_checks}
    tensors: dict[str, torch.Tensor] = {f"init/{k}": v for k, v in gather_full_state(model, groups.tp).items()}
    model.train()
    for step in range(1, cfg["steps"] + 1):
        batches = [task.microbatch(step, dp_rank * num_micro + i, cfg["mbs"]) for i in range(num_micro)]
        opt.zero_grad()
        result = forward_backward(model, batches, groups)
        update = opt.prepare(num_tokens=result.num_tokens)
        record["losses"].append(result.loss)
        record["grad_norms"].append(update.grad_norm)
        record["clip_coefs"].append(update.clip_coef)
        record["skipped"].append(update.skipped)
        record["tokens"].append(result.global_tokens)
        if logra:
            for cname, s in _full_sketches(opt, groups).items():
                tensors[f"sketch/{step}/{cname}"] = s
        opt.apply(update)

    full = gather_full_state(model, groups.tp)
    tensors.update({f"weight/{k}": v for k, v in full.items()})
    params = [p for p in model.parameters()]
    record["dp_replica_max_diff"] = _max_replica_diff(params, groups.dp)
    replicated = [p for p in params if not getattr(p, "tensor_model_parallel", False)]
    record["tp_replica_max_diff"] = _max_replica_diff(replicated, groups.tp)
    # every model-parallel rank reports its diffs; take the worst
    diffs = torch.tensor([record["dp_replica_max_diff"], record["tp_replica_max_diff"]], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    record["dp_replica_max_diff"], record["tp_replica_max_diff"] = diffs.tolist()

    # one contribution per pipeline stage (its TP rank 0 of DP rank 0), merged on global rank 0
    mine = {"pp_rank": groups.pp_rank, "tensors": tensors} if groups.tp_rank == 0 and dp_rank == 0 else None
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() == 0:
        merged: dict[str, torch.Tensor] = {}
        stages = sorted(g["pp_rank"] for g in gathered if g is not None)
        assert stages == list(range(groups.pp_size)), f"expected one contribution per stage, got {stages}"
        for g in gathered:
            if g is None:
                continue
            for k, v in g["tensors"].items():
                assert k not in merged, f"{k} reported by two pipeline stages"
                merged[k] = v.contiguous()
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        save_file(merged, os.path.join(out_dir, f"{name}.safetensors"))
        record["seconds"] = time.perf_counter() - t0
        with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
            json.dump(record, fh, indent=1)
    dist.barrier()


def main(argv=None) -> int:
    from rank_main import rank_main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out_dir, jobs = parse_args(argv)

    def run() -> None:
        for name, cfg in jobs:
            run_job(name, cfg, out_dir)

    return rank_main(run)


if __name__ == "__main__":
    sys.exit(main())

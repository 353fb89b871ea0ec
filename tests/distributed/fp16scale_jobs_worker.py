"""Several float16 training runs in one launch, recording what every rank's optimizer decided.

Used by the ``test_fp16scale_*`` tests (through :func:`run_jobs`)::

    python fp16scale_jobs_worker.py OUT_DIR '[["label", ["lm-tiny", "--fp16", "key=value", ...]], ...]'

Each job is a recipe and its overrides as ``megatron-logra train`` takes them, run as the CLI runs it
(``run_lm`` for ``job=lm``, ``run_rl`` for ``job=rl``), one after another in one process (each
re-initialises the parallel groups and seeds, as a fresh process would; a launch costs seconds of imports).
Every call of the optimizer's ``prepare`` on every rank is recorded: the update it prepared (step, the loss
scale its backward ran at, skipped, overflow), the scale the next backward runs at, and whether this rank's own
sketches or gradients were non-finite before the flag was reduced over the model-parallel group. Each rank writes
``OUT_DIR/<label>.rank<R>.json``; global rank 0 also ``OUT_DIR/<label>.summary.json``. A failing job
stops the launch (its peers may wait in a collective).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Mapping, Sequence

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


WORKER = Path(__file__).resolve()
COMMON_LM = ["train.eval_interval=0", "train.progress=false", "train.micro_batch_size=4", "train.global_batch_size=8",
             "model.hidden_dropout=0.0", "parallel.timeout_minutes=2"]
"""lm-tiny in small batches (8 sequences a step, so DP 2 takes two micro-batches of 4 as one process does), no
dropout (TP and PP then compute the same function as one process), a hang failing after 2 minutes."""
COMMON_RL = ["rl.eval_interval=0", "task.num_eval=0", "train.progress=false", "rl.prompts_per_step=4",
             "rl.group_size=4", "parallel.timeout_minutes=2"]
"""The tiny RL recipe with small steps (4 prompts x 4 samples), no held-out evaluation."""


class Runs:
    """What one launch of the worker left in ``out``: per job, every rank's prepare calls and rank 0's
    metrics.jsonl records."""

    def __init__(self, out: Path, nproc: int, run_dirs: Mapping[str, Path]) -> None:
        self.out, self.nproc, self.run_dirs = out, nproc, dict(run_dirs)

    def prepares(self, label: str) -> list[list[dict]]:
        """Every rank's ``prepare`` calls, in rank order."""
        return [json.loads((self.out / f"{label}.rank{r}.json").read_text())["prepares"] for r in range(self.nproc)]

    def agreed(self, label: str) -> list[dict]:
        """The ``prepare`` calls, after checking that every rank made the same ones with the same outcome
        (``local_overflow``, this rank's own flag before the reduction, left out)."""
        ranks = [[{k: v for k, v in c.items() if k != "local_overflow"} for c in calls]
                 for calls in self.prepares(label)]
        for r, calls in enumerate(ranks[1:], start=1):
            assert calls == ranks[0], f"{label}: rank {r} prepared {calls}, rank 0 {ranks[0]}"
        assert ranks[0], f"{label}: no update was prepared"
        return ranks[0]

    def records(self, label: str) -> list[dict]:
        """The job's step records (metrics.jsonl lines with a step and a loss_scale)."""
        lines = (self.run_dir(label) / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "step" in r and "loss_scale" in r]

    def run_dir(self, label: str) -> Path:
        return self.run_dirs[label]


def run_jobs(launcher, nproc: int, out: Path, jobs: Mapping[str, Sequence[str]], *, timeout: float = 300) -> Runs:
    """Run ``jobs`` (label -> recipe and overrides; ``train.run_dir`` is ``out/label`` unless given) in one
    launch of ``nproc`` ranks."""
    out.mkdir(parents=True, exist_ok=True)
    run_dirs = {}
    for label, argv in jobs.items():
        given = [a.split("=", 1)[1] for a in argv if a.startswith("train.run_dir=")]
        run_dirs[label] = Path(given[-1]) if given else out / label
    spec = [[label, [*argv, f"train.run_dir={run_dirs[label]}"]] for label, argv in jobs.items()]
    launcher.launch(nproc, [str(WORKER), str(out), json.dumps(spec)], timeout=timeout, log=out / "launch.log")
    return Runs(out, nproc, run_dirs)


class _Recorder:
    """Wraps the optimizers' ``prepare`` and the overflow flag's reduction in it (the real ones run) to record
    each prepared update and this rank's own flag before the reduction (``local_overflow``)."""

    def __init__(self) -> None:
        from megatron_logra.optim import dense, logra

        self.calls: list[dict] = []
        self._local: list[bool] = []
        self._patches = [(dense, "reduce_flag_any", self._reduce), (logra, "reduce_flag_any", self._reduce),
                         (dense.DenseAdamW, "prepare", self._prepare(dense.DenseAdamW.prepare)),
                         (logra.LograOptimizer, "prepare", self._prepare(logra.LograOptimizer.prepare))]
        self._originals = [(owner, name, getattr(owner, name)) for owner, name, _ in self._patches]
        from megatron_logra.optim.native import reduce_flag_any

        self._reduce_flag_any = reduce_flag_any

    def _reduce(self, flag, group, device):
        self._local.append(bool(flag))
        return self._reduce_flag_any(flag, group, device)

    def _prepare(self, original):
        calls, local = self.calls, self._local

        def prepare(opt, *args, **kwargs):
            local.clear()
            update = original(opt, *args, **kwargs)
            calls.append({"step": update.step, "loss_scale": update.loss_scale, "skipped": bool(update.skipped),
                          "overflow": bool(update.overflow), "next_scale": opt.loss_scale,
                          "num_skipped": opt.num_skipped, "local_overflow": any(local)})
            return update

        return prepare

    def __enter__(self) -> "_Recorder":
        for owner, name, value in self._patches:
            setattr(owner, name, value)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in self._originals:
            setattr(owner, name, value)


def main() -> int:
    out_dir, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    import torch.distributed as dist

    from megatron_logra.cli.train import split_recipe
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl
    from megatron_logra.train.lm import run_lm

    for label, argv in jobs:
        recipe, overrides = split_recipe(argv)
        cfg = parse_args_to_config(recipe, overrides)
        try:
            with warnings.catch_warnings(), _Recorder() as recorder:
                warnings.simplefilter("ignore")
                summary = run_rl(cfg) if cfg.job == "rl" else run_lm(cfg)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out_dir / f"{label}.rank{rank}.json").write_text(json.dumps({"prepares": recorder.calls}, indent=1))
        if rank == 0:
            (out_dir / f"{label}.summary.json").write_text(json.dumps(summary, indent=1))
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint resume through the CLI is bitwise exact, and a damaged checkpoint fails clearly.

For one process and for DP=2 (torchrun): an uninterrupted run of N steps (saving every K) is
compared with a run stopped after K steps (``train.steps=K``) and resumed in a fresh process
(``python -m megatron_logra.cli train train.steps=N train.resume=true``). The final checkpoints'
model, optimizer and per-rank RNG tensors must be bitwise equal, and so must every step's
loss / grad norm / clip coefficient / token count in metrics.jsonl. Hidden dropout is on (it
draws from the default generator), so the RNG state must be restored too.

To save start-ups (~10 s of imports each on 2 cores), the uninterrupted and the stopped run of
a layout share one launch of ``resume_driver.py`` (``run_lm`` twice; ``initialize_parallel``
re-seeds everything, so each starts as a fresh process would); only the resume is a fresh CLI
process. The 1-process driver also runs
* a run with *attention* dropout, stopped at K and resumed: attention dropout forks megatron's
  tensor-parallel RNG tracker, whose state must be checkpointed as well;
* resume attempts through ``cli.main`` (the CLI's entry point) from damaged copies of the
  uninterrupted run, which must raise ``CheckpointError`` with a message that names the problem
  (the exception propagates out of ``cli.main``, so ``python -m megatron_logra.cli`` exits
  non-zero with it) and leave the run untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

N, K = 5, 3
COMMON = [
    "train.progress=false", "train.eval_interval=0", f"train.save_interval={K}",
    "train.micro_batch_size=8", "train.global_batch_size=16", "train.log_interval=100",
    "model.hidden_dropout=0.1",
]
COMPARED = ("loss", "grad_norm", "clip_coef", "skipped", "tokens")
ATTENTION = ("model.attention_dropout=0.1",)
DRIVER = Path(__file__).resolve().parent / "resume_driver.py"


def _train_args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "lm-tiny", f"train.run_dir={run_dir}", f"train.steps={steps}", *COMMON, *extra]


def _summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"): stdout.rindex("}") + 1])  # rank 0's summary


def _cli(launcher, nproc: int, run_dir: Path, steps: int, *extra: str) -> dict:
    """A fresh ``python -m megatron_logra.cli train ...`` (for nproc > 1 real torchrun, started cold:
    the command a user types); rank 0's summary."""
    proc = launcher.launch(nproc, ["-m", "megatron_logra.cli", *_train_args(run_dir, steps, *extra)],
                           timeout=300, cold=nproc > 1, log=run_dir.with_name(run_dir.name + f".steps{steps}.log"))
    return _summary(proc.stdout)


def _drive(launcher, nproc: int, base: Path, ops: list, name: str) -> dict:
    """Run ``ops`` in one launch of ``resume_driver.py``; its results by label."""
    out = base / f"{name}.json"
    launcher.launch(nproc, [str(DRIVER), str(out), json.dumps([[str(x) if isinstance(x, Path) else x for x in op]
                                                                 for op in ops])],
                    timeout=400, log=base / f"{name}.log")
    return json.loads(out.read_text())


def _latest(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


_CACHE: dict = {}

LAST = f"step_{N:08d}"
# case -> (damage operations on a copy RUN of the 1-process uninterrupted run, words the error must contain)
CORRUPTIONS = {
    "truncated_shard": (lambda run: [["truncate", run / "checkpoints" / LAST / "dist" / "__0_0.distcp"]],
                        [LAST, "__0_0.distcp", "truncated"]),
    "truncated_index": (lambda run: [["truncate", run / "checkpoints" / LAST / "dist" / ".metadata"]],
                        [LAST, ".metadata", "truncated"]),
    "missing_shard": (lambda run: [["unlink", run / "checkpoints" / LAST / "dist" / "__0_1.distcp"]],
                      [LAST, "__0_1.distcp", "missing"]),
    "missing_meta": (lambda run: [["unlink", run / "checkpoints" / LAST / "meta.json"]], [LAST, "meta.json"]),
    "corrupt_meta": (lambda run: [["write", run / "checkpoints" / LAST / "meta.json", "{not json"]],
                     [LAST, "meta.json", "corrupt"]),
    "old_format": (lambda run: [["write", run / "checkpoints" / LAST / "meta.json", '{"format_version": 1}']],
                   [LAST, "format version 1"]),
    "dangling_latest": (lambda run: [["write", run / "checkpoints" / "latest", "step_00000099"]], ["step_00000099"]),
}
# the same run under the (layout-independent) checkpoint format, saved at TP=2 and resumed at TP=1:
# no dropout, so TP=1 and TP=2 compute the same function
TP_ARGS = ("--tensor-model-parallel-size", "2")
NO_DROPOUT = ("model.hidden_dropout=0.0",)


def _runs(launcher, tmp_path_factory, nproc: int) -> dict:
    """Launch 1 (driver): the uninterrupted N-step run and the K-step run, plus for nproc=1 the
    attention-dropout trio and the damaged-checkpoint resumes. Launch 2: a fresh CLI process
    resumes the K-step run to N. Cached per nproc."""
    if nproc in _CACHE:
        return _CACHE[nproc]
    base = tmp_path_factory.mktemp(f"resume_np{nproc}")
    full, stopped, pristine = base / "full", base / "stopped", base / "stopped_at_K"
    ops = [["run", "full", _train_args(full, N)], ["run", "stop", _train_args(stopped, K)],
           ["copy", stopped, pristine]]
    entry = {"nproc": nproc, "full": full, "resumed": stopped, "pristine": pristine, "base": base}
    if nproc == 1:
        a_full, a_stop = base / "attn_full", base / "attn_stopped"
        ops += [["run", "attn_full", _train_args(a_full, N, *ATTENTION)],
                ["run", "attn_stop", _train_args(a_stop, K, *ATTENTION)],
                ["copy", a_stop, base / "attn_stopped_at_K"],
                ["run", "attn_resume", _train_args(a_stop, N, "train.resume=true", *ATTENTION)]]
        entry["attn"] = {"nproc": 1, "full": a_full, "resumed": a_stop, "pristine": base / "attn_stopped_at_K"}
        entry["corrupt"] = {}
        for case, (damage, _) in CORRUPTIONS.items():
            run = base / f"corrupt_{case}"
            ops += [["copy", full, run], *damage(run), ["cli", case, _train_args(run, N + 1, "train.resume=true")]]
            entry["corrupt"][case] = run
    if nproc == 2:
        tp2, tp1 = base / "tp2_full", base / "tp2_to_tp1"
        ops += [["run", "tp2_full", _train_args(tp2, N, *TP_ARGS, *NO_DROPOUT)], ["copy", tp2, tp1],
                ["write", tp1 / "checkpoints" / "latest", f"step_{K:08d}"]]
        entry["tp2"], entry["tp1"] = tp2, tp1
    results = _drive(launcher, nproc, base, ops, "driver")
    entry["results"] = results
    s_res = _cli(launcher, nproc, stopped, N, "train.resume=true")
    entry["summaries"] = (results["full"]["summary"], results["stop"]["summary"], s_res)
    if nproc == 2:  # `train --resume RUN_DIR` at another layout: the saved config, TP overridden
        proc = launcher.launch(1, ["-m", "megatron_logra.cli", "train", "--resume", str(entry["tp1"]),
                                   "--tensor-model-parallel-size", "1"], timeout=300,
                               log=base / "tp2_to_tp1.log")
        entry["tp1_summary"] = _summary(proc.stdout)
    _CACHE[nproc] = entry
    return entry


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every global tensor of a checkpoint (model and optimizer) plus each rank's RNG states."""
    from megatron_logra.checkpoint.plain import PlainCheckpoint

    out = PlainCheckpoint(ckpt).read_all()
    for f in sorted(ckpt.glob("rng_rank*.safetensors")):
        out.update({f"{f.stem}.{k}": v for k, v in load_file(str(f)).items()})
    return out


def assert_resume_bitwise(runs: dict) -> None:
    nproc = runs["nproc"]
    full, resumed = runs["full"], runs["resumed"]
    s_full, s_stop, s_res = runs["summaries"]
    # the second process really resumed at K (a silent restart from scratch would also end equal)
    assert (s_full["steps"], s_stop["steps"], s_res["steps"]) == (N, K, N)
    assert (s_full["segment_steps"], s_stop["segment_steps"], s_res["segment_steps"]) == (N, K, N - K)
    assert s_res["resumed_from_step"] == K and s_res["first_loss"] == s_full["first_loss"]

    ck_full, ck_res = _latest(full), _latest(resumed)
    assert ck_full.name == ck_res.name == f"step_{N:08d}"
    meta_full = json.loads((ck_full / "meta.json").read_text())
    meta = json.loads((ck_res / "meta.json").read_text())
    assert (meta["step"], meta["dp"], meta["world_size"]) == (N, nproc, nproc)
    assert meta["state"] == meta_full["state"]  # optimizer counters, lr
    assert len(list(ck_res.glob("rng_rank*.safetensors"))) == nproc
    a, b = _tensors(ck_full), _tensors(ck_res)
    assert set(a) == set(b), f"tensor names differ: {sorted(set(a) ^ set(b))[:6]}"
    assert any(k.startswith("optimizer.native.exp_avg.") for k in a) and any(".row_moment." in k for k in a)
    for key in a:  # model, optimizer (moments, row moments) and per-rank RNG states
        assert torch.equal(a[key], b[key]), (
            f"{key} differs after resume (max {float((a[key].double() - b[key].double()).abs().max()):.3g})"
        )
    # the weights did train after K (equality of untouched weights would be vacuous)
    from megatron_logra.checkpoint.plain import PlainCheckpoint

    at_k = PlainCheckpoint(runs["pristine"] / "checkpoints" / f"step_{K:08d}")
    key = "decoder.layers.self_attention.linear_qkv.weight"
    assert not torch.equal(at_k.read(key), b[key]), "no weight changed between step K and N"

    m_full, m_res = _metrics(full), _metrics(resumed)
    assert [r["step"] for r in m_full] == list(range(1, N + 1))
    assert [r["step"] for r in m_res] == list(range(1, N + 1)), "resumed metrics.jsonl must hold each step once"
    for a, b in zip(m_full, m_res):
        for key in COMPARED:
            assert a[key] == b[key], f"step {a['step']}: {key} {a[key]!r} (uninterrupted) vs {b[key]!r} (resumed)"
    for r in m_full:  # throughput of the global batch; no accelerator here
        assert r["tokens_per_second"] == pytest.approx(r["tokens"] / r["step_seconds"])
        assert r["gpu_memory_peak_bytes"] is None


@pytest.mark.parametrize("nproc", [1, 2], ids=["single", "dp2"])
def test_resume_is_bitwise(launcher, tmp_path_factory, nproc):
    assert_resume_bitwise(_runs(launcher, tmp_path_factory, nproc))


def test_corrupt_checkpoint_fails_with_clear_error(launcher, tmp_path_factory):
    """Resume from a damaged latest checkpoint raises CheckpointError naming the problem, before
    touching the run (metrics.jsonl unchanged, no new checkpoint)."""
    runs = _runs(launcher, tmp_path_factory, 1)
    before = (runs["full"] / "metrics.jsonl").read_text()
    problems = []
    for case, (_, needles) in CORRUPTIONS.items():
        got = runs["results"][case]["error"]
        if got is None:
            problems.append(f"{case}: resume did not fail")
            continue
        kind, message = got
        if kind != "CheckpointError":
            problems.append(f"{case}: raised {kind}, expected CheckpointError: {message}")
        missing = [n for n in needles if n not in message]
        if missing:
            problems.append(f"{case}: message does not name {missing}: {message!r}")
        run = runs["corrupt"][case]
        if (run / "metrics.jsonl").read_text() != before:
            problems.append(f"{case}: metrics.jsonl was modified by the failed resume")
        if (run / "checkpoints" / f"step_{N + 1:08d}").exists():
            problems.append(f"{case}: a new checkpoint was written")
    assert not problems, "\n".join(problems)


def test_resume_restores_rng_tracker(launcher, tmp_path_factory):
    runs = _runs(launcher, tmp_path_factory, 1)
    attn = dict(runs["attn"])
    attn["summaries"] = tuple(runs["results"][k]["summary"] for k in ("attn_full", "attn_stop", "attn_resume"))
    assert_resume_bitwise(attn)


def test_resume_at_another_tensor_parallel_size(launcher, tmp_path_factory):
    """A run saved at TP=2 continues at TP=1 (``train --resume RUN_DIR --tensor-model-parallel-size 1``):
    the sharded checkpoint is resharded (weights, AdamW moments, LoGRA row moments of column- and
    row-parallel layers) and the following steps have the same loss as the uninterrupted TP=2 run."""
    runs = _runs(launcher, tmp_path_factory, 2)
    assert (runs["tp1_summary"]["steps"], runs["tp1_summary"]["segment_steps"]) == (N, N - K)
    meta = json.loads((_latest(runs["tp1"]) / "meta.json").read_text())
    assert (meta["tp"], meta["world_size"]) == (1, 1)
    m2, m1 = _metrics(runs["tp2"]), _metrics(runs["tp1"])
    assert [r["step"] for r in m1] == list(range(1, N + 1))
    for a, b in zip(m2[K:], m1[K:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), f"step {a['step']}: loss at TP=2 {a['loss']} vs TP=1 {b['loss']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    t2, t1 = _tensors(_latest(runs["tp2"])), _tensors(_latest(runs["tp1"]))
    model_keys = [k for k in t2 if not k.startswith("rng_rank")]
    assert set(model_keys) == {k for k in t1 if not k.startswith("rng_rank")}
    for key in model_keys:
        torch.testing.assert_close(t1[key], t2[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")

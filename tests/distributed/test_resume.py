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
    """A fresh ``python -m megatron_logra.cli train ...`` (torchrun for nproc > 1); rank 0's summary."""
    proc = launcher.launch(nproc, ["-m", "megatron_logra.cli", *_train_args(run_dir, steps, *extra)],
                           timeout=300, log=run_dir.with_name(run_dir.name + f".steps{steps}.log"))
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
    "truncated_model": (lambda run: [["truncate", run / "checkpoints" / LAST / "model_tp0_pp0.safetensors"]],
                        [LAST, "tp0_pp0"]),
    "truncated_optim": (lambda run: [["truncate", run / "checkpoints" / LAST / "optim_tp0_pp0.safetensors"]],
                        [LAST, "tp0_pp0"]),
    "missing_meta": (lambda run: [["unlink", run / "checkpoints" / LAST / "meta.json"]], [LAST, "meta.json"]),
    "corrupt_meta": (lambda run: [["write", run / "checkpoints" / LAST / "meta.json", "{not json"]],
                     [LAST, "meta.json", "corrupt"]),
    "missing_optim": (lambda run: [["unlink", run / "checkpoints" / LAST / "optim_tp0_pp0.safetensors"]],
                      [LAST, "optim_tp0_pp0.safetensors"]),
    "dangling_latest": (lambda run: [["write", run / "checkpoints" / "latest", "step_00000099"]], ["step_00000099"]),
}


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
    results = _drive(launcher, nproc, base, ops, "driver")
    entry["results"] = results
    s_res = _cli(launcher, nproc, stopped, N, "train.resume=true")
    entry["summaries"] = (results["full"]["summary"], results["stop"]["summary"], s_res)
    _CACHE[nproc] = entry
    return entry


def assert_resume_bitwise(runs: dict) -> None:
    nproc = runs["nproc"]
    full, resumed = runs["full"], runs["resumed"]
    s_full, s_stop, s_res = runs["summaries"]
    # the second process really resumed at K (a silent restart from scratch would also end equal)
    assert (s_full["steps"], s_stop["steps"], s_res["steps"]) == (N, K, N - K)

    ck_full, ck_res = _latest(full), _latest(resumed)
    assert ck_full.name == ck_res.name == f"step_{N:08d}"
    meta = json.loads((ck_res / "meta.json").read_text())
    assert (meta["step"], meta["dp"], meta["world_size"]) == (N, nproc, nproc)
    files = sorted(p.name for p in ck_full.glob("*.safetensors"))
    assert "model_tp0_pp0.safetensors" in files and "optim_tp0_pp0.safetensors" in files
    assert len([f for f in files if f.startswith("rng_rank")]) == nproc
    assert files == sorted(p.name for p in ck_res.glob("*.safetensors"))
    for name in files:  # model, optimizer and per-rank RNG states
        a, b = load_file(str(ck_full / name)), load_file(str(ck_res / name))
        assert set(a) == set(b), f"{name}: tensor names differ"
        for key in a:
            assert torch.equal(a[key], b[key]), (
                f"{name}:{key} differs after resume (max {float((a[key].double() - b[key].double()).abs().max()):.3g})"
            )
    assert json.loads((ck_full / "optim_tp0_pp0.json").read_text()) == json.loads(
        (ck_res / "optim_tp0_pp0.json").read_text())
    # the weights did train after K (equality of untouched weights would be vacuous)
    at_k = load_file(str(runs["pristine"] / "checkpoints" / f"step_{K:08d}" / "model_tp0_pp0.safetensors"))
    final = load_file(str(ck_res / "model_tp0_pp0.safetensors"))
    assert any(not torch.equal(at_k[k], final[k]) for k in final), "no weight changed between step K and N"

    m_full, m_res = _metrics(full), _metrics(resumed)
    assert [r["step"] for r in m_full] == list(range(1, N + 1))
    assert [r["step"] for r in m_res] == list(range(1, N + 1)), "resumed metrics.jsonl must hold each step once"
    for a, b in zip(m_full, m_res):
        for key in COMPARED:
            assert a[key] == b[key], f"step {a['step']}: {key} {a[key]!r} (uninterrupted) vs {b[key]!r} (resumed)"


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

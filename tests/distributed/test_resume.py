"""Checkpoint resume through the CLI is bitwise exact, and a damaged checkpoint fails clearly.

For one process and for DP=2 (torchrun): an uninterrupted run of N steps (saving every K) is
compared with a run stopped after K steps (``train.steps=K``) and resumed in a fresh process
(``train.steps=N train.resume=true``). The final checkpoints' model, optimizer and per-rank RNG
tensors must be bitwise equal, and so must every step's loss / grad norm / clip coefficient in
metrics.jsonl. Hidden dropout is on (it draws from the default generator), so the RNG state must
be restored too.

One more process (the "driver") calls the CLI's entry point ``cli.main`` several times:
* a run with *attention* dropout, stopped at K and resumed: attention dropout forks megatron's
  tensor-parallel RNG tracker, whose state must be checkpointed as well (a fresh
  ``initialize_parallel`` re-seeds the tracker exactly as a fresh process does);
* resume attempts from damaged copies of the 1-process run, which must raise ``CheckpointError``
  with a message that names the problem (the exception propagates out of ``cli.main``, so
  ``python -m megatron_logra.cli`` exits non-zero with it).
"""

from __future__ import annotations

import json
import shutil
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


def _train_args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "lm-tiny", f"train.run_dir={run_dir}", f"train.steps={steps}", *COMMON, *extra]


def _summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"): stdout.rindex("}") + 1])  # rank 0's summary


def _cli(launcher, nproc: int, run_dir: Path, steps: int, *extra: str) -> dict:
    proc = launcher.launch(nproc, ["-m", "megatron_logra.cli", *_train_args(run_dir, steps, *extra)],
                           timeout=300, log=run_dir.with_name(run_dir.name + f".steps{steps}.log"))
    return _summary(proc.stdout)


def _latest(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


_CACHE: dict = {}


def _runs(launcher, tmp_path_factory, nproc: int) -> dict:
    """Uninterrupted N-step run, and a K-step run resumed to N in a fresh process (cached)."""
    if nproc not in _CACHE:
        base = tmp_path_factory.mktemp(f"resume_np{nproc}")
        full, stopped = base / "full", base / "stopped"
        s_full = _cli(launcher, nproc, full, N)
        s_stop = _cli(launcher, nproc, stopped, K)
        pristine = base / "stopped_at_K"
        shutil.copytree(stopped, pristine)
        s_res = _cli(launcher, nproc, stopped, N, "train.resume=true")
        _CACHE[nproc] = {"nproc": nproc, "full": full, "resumed": stopped, "pristine": pristine,
                         "summaries": (s_full, s_stop, s_res)}
    return _CACHE[nproc]


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


# --------------------------------------------------------------------------- driver (one process, many cli.main)

_DRIVER = r"""
import contextlib, io, json, shutil, sys
from megatron_logra import cli
out = {}
for label, argv in json.loads(sys.argv[1]):
    if label.startswith("copy:"):
        shutil.copytree(*argv)
        continue
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            cli.main(argv)
        out[label] = {"error": None, "stdout": buf.getvalue()}
    except Exception as exc:
        out[label] = {"error": [type(exc).__name__, str(exc)], "stdout": buf.getvalue()}
print("RESULT=" + json.dumps(out))
"""


def _damage_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


LAST = f"step_{N:08d}"
# case -> (damage(checkpoints root, latest checkpoint dir), words the error message must contain)
CORRUPTIONS = {
    "truncated_model": (lambda root, ck: _damage_truncate(ck / "model_tp0_pp0.safetensors"), [LAST, "tp0_pp0"]),
    "truncated_optim": (lambda root, ck: _damage_truncate(ck / "optim_tp0_pp0.safetensors"), [LAST, "tp0_pp0"]),
    "missing_meta": (lambda root, ck: (ck / "meta.json").unlink(), [LAST, "meta.json"]),
    "corrupt_meta": (lambda root, ck: (ck / "meta.json").write_text("{not json"), [LAST, "meta.json", "corrupt"]),
    "missing_optim": (lambda root, ck: (ck / "optim_tp0_pp0.safetensors").unlink(), [LAST, "optim_tp0_pp0.safetensors"]),
    "dangling_latest": (lambda root, ck: (root / "latest").write_text("step_00000099"), ["step_00000099"]),
}


@pytest.fixture(scope="module")
def driver(launcher, tmp_path_factory):
    single = _runs(launcher, tmp_path_factory, 1)
    base = tmp_path_factory.mktemp("driver")
    calls = []
    # attention dropout: uninterrupted, stopped at K, resumed
    a_full, a_stop = base / "attn_full", base / "attn_stopped"
    calls += [["attn_full", _train_args(a_full, N, *ATTENTION)], ["attn_stop", _train_args(a_stop, K, *ATTENTION)],
              ["copy:attn", [str(a_stop), str(base / "attn_stopped_at_K")]],
              ["attn_resume", _train_args(a_stop, N, "train.resume=true", *ATTENTION)]]
    # damaged copies of the 1-process uninterrupted run
    dirs = {}
    for case, (damage, _) in CORRUPTIONS.items():
        run = base / case
        shutil.copytree(single["full"], run)
        damage(run / "checkpoints", run / "checkpoints" / LAST)
        dirs[case] = run
        calls.append([case, _train_args(run, N + 1, "train.resume=true")])
    before = {case: (d / "metrics.jsonl").read_text() for case, d in dirs.items()}
    proc = launcher.launch(1, ["-c", _DRIVER, json.dumps(calls)], timeout=400, log=base / "driver.log")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert line, f"driver printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(line[-1][len("RESULT="):])
    return {"results": results, "dirs": dirs, "before": before,
            "attn": {"nproc": 1, "full": a_full, "resumed": a_stop, "pristine": base / "attn_stopped_at_K"}}


def test_corrupt_checkpoint_fails_with_clear_error(driver):
    """Resume from a damaged latest checkpoint raises CheckpointError naming the problem, before
    touching the run (metrics.jsonl unchanged, no new checkpoint)."""
    problems = []
    for case, (_, needles) in CORRUPTIONS.items():
        got = driver["results"][case]["error"]
        if got is None:
            problems.append(f"{case}: resume did not fail")
            continue
        kind, message = got
        if kind != "CheckpointError":
            problems.append(f"{case}: raised {kind}, expected CheckpointError: {message}")
        missing = [n for n in needles if n not in message]
        if missing:
            problems.append(f"{case}: message does not name {missing}: {message!r}")
        run = driver["dirs"][case]
        if (run / "metrics.jsonl").read_text() != driver["before"][case]:
            problems.append(f"{case}: metrics.jsonl was modified by the failed resume")
        if (run / "checkpoints" / f"step_{N + 1:08d}").exists():
            problems.append(f"{case}: a new checkpoint was written")
    assert not problems, "\n".join(problems)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "BUG (megatron_logra/checkpoint.py): save_checkpoint/load_checkpoint keep torch.get_rng_state() but not "
    "megatron's tensor-parallel RNG tracker states (tensor_parallel.get_cuda_rng_tracker().get_states()), "
    "which attention dropout forks from; a resumed run draws other attention-dropout masks. "
    "Remove this mark once fixed."))
def test_resume_restores_rng_tracker(driver):
    res = driver["results"]
    for label in ("attn_full", "attn_stop", "attn_resume"):
        if res[label]["error"] is not None:
            pytest.fail(f"{label} failed: {res[label]['error']}")
    runs = dict(driver["attn"])
    runs["summaries"] = tuple(_summary(res[label]["stdout"]) for label in ("attn_full", "attn_stop", "attn_resume"))
    assert_resume_bitwise(runs)

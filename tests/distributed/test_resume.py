"""Checkpoint resume through the CLI is bitwise exact, and a damaged checkpoint fails clearly.

For one process and for DP=2 (torchrun): an uninterrupted run of N steps (saving every K) is
compared with a run stopped after K steps (``train.steps=K``) and resumed in a fresh process
(``train.steps=N train.resume=true``). The final checkpoints' model *and* optimizer tensors must
be bitwise equal, and so must every step's loss / grad norm / clip coefficient in metrics.jsonl.
Hidden dropout is on (it draws from the default generator), so the RNG state must be restored
too. Attention dropout draws from megatron's tensor-parallel RNG tracker, whose state must be
checkpointed as well (``test_resume_restores_rng_tracker``).
"""

from __future__ import annotations

import json
import shutil
import sys
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


def _train_args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", f"train.run_dir={run_dir}", f"train.steps={steps}", *COMMON, *extra]


def _cli(launcher, nproc: int, run_dir: Path, steps: int, *extra: str) -> dict:
    proc = launcher.launch(nproc, ["-m", "megatron_logra.cli", *_train_args(run_dir, steps, *extra)],
                           timeout=300, log=run_dir.with_name(run_dir.name + f".steps{steps}.log"))
    text = proc.stdout
    return json.loads(text[text.index("{"): text.rindex("}") + 1])  # rank 0's summary


def _latest(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


_CACHE: dict[tuple, dict] = {}


def _runs(launcher, tmp_path_factory, nproc: int, *extra: str) -> dict:
    """Uninterrupted N-step run, and a K-step run resumed to N in a fresh process (cached)."""
    key = (nproc, *extra)
    if key not in _CACHE:
        base = tmp_path_factory.mktemp(f"resume_np{nproc}")
        full, stopped = base / "full", base / "stopped"
        s_full = _cli(launcher, nproc, full, N, *extra)
        s_stop = _cli(launcher, nproc, stopped, K, *extra)
        pristine = base / "stopped_at_K"
        shutil.copytree(stopped, pristine)
        s_res = _cli(launcher, nproc, stopped, N, "train.resume=true", *extra)
        _CACHE[key] = {"nproc": nproc, "full": full, "resumed": stopped, "pristine": pristine,
                       "summaries": (s_full, s_stop, s_res)}
    return _CACHE[key]


@pytest.mark.parametrize("nproc", [1, 2], ids=["single", "dp2"])
def test_resume_is_bitwise(launcher, tmp_path_factory, nproc):
    assert_resume_bitwise(_runs(launcher, tmp_path_factory, nproc))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "BUG (megatron_logra/checkpoint.py): save_checkpoint/load_checkpoint keep torch.get_rng_state() but not "
    "megatron's tensor-parallel RNG tracker states (get_cuda_rng_tracker().get_states()), which attention "
    "dropout forks from; a resumed run draws other attention-dropout masks. Remove this mark once fixed."))
def test_resume_restores_rng_tracker(launcher, tmp_path_factory):
    assert_resume_bitwise(_runs(launcher, tmp_path_factory, 1, "model.attention_dropout=0.1"))


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
    # the weights did train (equality of untouched weights would be vacuous)
    init = load_file(str(runs["pristine"] / "checkpoints" / f"step_{K:08d}" / "model_tp0_pp0.safetensors"))
    final = load_file(str(ck_res / "model_tp0_pp0.safetensors"))
    assert any(not torch.equal(init[k], final[k]) for k in final), "no weight changed between step K and N"

    m_full, m_res = _metrics(full), _metrics(resumed)
    assert [r["step"] for r in m_full] == list(range(1, N + 1))
    assert [r["step"] for r in m_res] == list(range(1, N + 1)), "resumed metrics.jsonl must hold each step once"
    for a, b in zip(m_full, m_res):
        for key in COMPARED:
            assert a[key] == b[key], f"step {a['step']}: {key} {a[key]!r} (uninterrupted) vs {b[key]!r} (resumed)"


_DRIVER = r"""
import json, sys
from megatron_logra import cli
cases = json.loads(sys.argv[1])
out = {}
for case, argv in cases.items():
    try:
        cli.main(argv)
        out[case] = None
    except Exception as exc:
        out[case] = [type(exc).__name__, str(exc)]
print("RESULT=" + json.dumps(out))
"""


def test_corrupt_checkpoint_fails_with_clear_error(launcher, tmp_path_factory):
    """Resume from a damaged latest checkpoint raises CheckpointError naming the problem.

    All cases run in one process through ``cli.main`` (the CLI's entry point: the exception
    propagates out of it, so ``python -m megatron_logra.cli`` exits non-zero with it).
    """
    runs = _runs(launcher, tmp_path_factory, 1)
    base = tmp_path_factory.mktemp("corrupt")
    last = f"step_{N:08d}"

    def damaged(case: str, damage) -> Path:
        run = base / case
        shutil.copytree(runs["full"], run)
        damage(run / "checkpoints", run / "checkpoints" / last)
        return run

    def truncate(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    cases = {
        "truncated_model": (lambda root, ck: truncate(ck / "model_tp0_pp0.safetensors"),
                            [last, "model_tp0_pp0"]),
        "truncated_optim": (lambda root, ck: truncate(ck / "optim_tp0_pp0.safetensors"),
                            [last, "optim_tp0_pp0"]),
        "missing_meta": (lambda root, ck: (ck / "meta.json").unlink(), [last, "meta.json"]),
        "corrupt_meta": (lambda root, ck: (ck / "meta.json").write_text("{not json"), [last, "meta.json", "corrupt"]),
        "missing_optim": (lambda root, ck: (ck / "optim_tp0_pp0.safetensors").unlink(),
                          [last, "optim_tp0_pp0.safetensors"]),
        "dangling_latest": (lambda root, ck: (root / "latest").write_text("step_00000099"), ["step_00000099"]),
    }
    dirs = {case: damaged(case, dmg) for case, (dmg, _) in cases.items()}
    before = {case: (d / "metrics.jsonl").read_text() for case, d in dirs.items()}
    argvs = {case: _train_args(d, N + 1, "train.resume=true") for case, d in dirs.items()}
    proc = launcher.launch(1, ["-c", _DRIVER, json.dumps(argvs)], timeout=300, log=base / "driver.log")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert line, f"driver printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(line[-1][len("RESULT="):])
    problems = []
    for case, (_, needles) in cases.items():
        got = results.get(case)
        if got is None:
            problems.append(f"{case}: resume did not fail")
            continue
        kind, message = got
        if kind != "CheckpointError":
            problems.append(f"{case}: raised {kind}, expected CheckpointError: {message}")
        missing = [n for n in needles if n not in message]
        if missing:
            problems.append(f"{case}: message does not name {missing}: {message!r}")
        # a failed resume must not touch the run's records
        if (dirs[case] / "metrics.jsonl").read_text() != before[case]:
            problems.append(f"{case}: metrics.jsonl was modified by the failed resume")
        if (dirs[case] / "checkpoints" / f"step_{N + 1:08d}").exists():
            problems.append(f"{case}: a new checkpoint was written")
    assert not problems, "\n".join(problems)

"""The RL job resumes bitwise: rollouts, rewards, KL control, LoGRA state and engine sync.

A 4-update run of the main recipe (small batches) is the reference. The same run stopped after
2 updates (``rl.steps=2``) and continued with ``train --resume RUN_DIR rl.steps=4`` in a fresh
process must produce the same metrics for updates 3-4 (reward, accuracy, predicted and actual KL,
α, sync bytes, ...) and bitwise the same final checkpoint: the EMA baseline, the KL controller's
calibration and mismatch, the weight version of the engine sync, the optimizer and the RNG
states all come back from the checkpoint.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from test_resume import _metrics, _tensors

pytestmark = pytest.mark.distributed

SMALL = ["train.progress=false", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_interval=0", "task.num_eval=8",
         "train.save_interval=2"]
COMPARED = ("reward_mean", "accuracy", "response_length", "kl_predicted", "kl_actual", "alpha", "budget", "mismatch",
            "update_ratio", "sync_bytes")


def _train(launcher, log: Path, nproc: int, *args: str) -> dict:
    proc = launcher.launch(nproc, ["-m", "megatron_logra.cli", "train", *args], timeout=400, log=log)
    return json.loads(proc.stdout[proc.stdout.index("{"): proc.stdout.rindex("}") + 1])


@pytest.mark.parametrize("nproc, extra", [(1, ["rl.loss.kl_coef=0.05"]), (2, ["--tensor-model-parallel-size", "2"])],
                         ids=["reference-kl", "tp2"])
def test_rl_resume_is_bitwise(launcher, tmp_path, nproc, extra):
    """reference-kl: the main recipe with a KL penalty, whose reference model adds the one piece of
    state a plain run lacks: after a resume it must be the initial policy again (warm-started, not
    a copy of the resumed weights). tp2: the resumed model is built without initialisation and
    loaded, its TP shards included (the first refit gathers them). Everything else resumes
    exactly as without either."""
    full, part = tmp_path / "full", tmp_path / "part"
    with ThreadPoolExecutor(2) as pool:  # independent single-process runs: side by side
        f_full = pool.submit(_train, launcher, tmp_path / "full.log", nproc, "tiny", f"train.run_dir={full}", "rl.steps=4",
                             *SMALL, *extra)
        f_part = pool.submit(_train, launcher, tmp_path / "part.log", nproc, "tiny", f"train.run_dir={part}", "rl.steps=2",
                             *SMALL, *extra)
        s_full, s_part = f_full.result(), f_part.result()
    s_res = _train(launcher, tmp_path / "resume.log", nproc, "--resume", str(part), "rl.steps=4")
    assert (s_full["steps"], s_part["steps"], s_res["steps"]) == (4, 2, 4)

    m_full, m_res = _metrics(full), _metrics(part)
    assert [r["step"] for r in m_res] == [1, 2, 3, 4]
    assert any(r["kl_actual"] for r in m_full), "the reference run applied no update"
    for a, b in zip(m_full, m_res):
        for key in COMPARED:
            assert a[key] == b[key], f"update {a['step']}: {key} {a[key]!r} (uninterrupted) vs {b[key]!r} (resumed)"
    name = "step_00000004"
    ref, got = _tensors(full / "checkpoints" / name), _tensors(part / "checkpoints" / name)
    assert set(ref) == set(got)
    for key in ref:
        assert torch.equal(ref[key], got[key]), f"{key} differs after resume"
    meta_ref = json.loads((full / "checkpoints" / name / "meta.json").read_text())
    meta_got = json.loads((part / "checkpoints" / name / "meta.json").read_text())
    assert meta_ref["state"] == meta_got["state"]  # optimizer counters, KL controller, RL loop state

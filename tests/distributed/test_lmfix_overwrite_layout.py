"""``train.overwrite=true`` deletes a previous run only after every check that can refuse the new one: a
batch layout that does not split over the DP ranks (2 gloo ranks) is refused, naming the fields with
their section, and leaves the old run's files in place."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

PREVIOUS = {
    "checkpoints/step_00000003/meta.json": "{}",
    "checkpoints/latest": "step_00000003",
    "metrics.jsonl": '{"step": 1, "loss": 3.5}\n',
    "summary.json": "{}",
    "config.yaml": "job: lm\n",
    "tensorboard/events.out": "x",
}


def test_a_refused_dp_layout_keeps_the_run_that_overwrite_would_replace(launcher, tmp_path):
    run = tmp_path / "run"
    for rel, text in PREVIOUS.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    proc = launcher.launch(2, ["-m", "megatron_logra.cli", "train", "lm-tiny", f"train.run_dir={run}",
                               "train.overwrite=true", "train.steps=1", "train.progress=false",
                               "train.micro_batch_size=32", "train.global_batch_size=32"],
                           check=False, timeout=180, log=tmp_path / "launch.log")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert ("train.global_batch_size=32 is not a multiple of train.micro_batch_size × dp = 32 × 2" in text), \
        text[-3000:]
    assert "removing the previous run" not in text
    for rel, content in PREVIOUS.items():
        assert (run / rel).read_text() == content, rel

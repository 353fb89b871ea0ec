"""The language-model job, recipes and ``megatron-logra config`` as a user meets them, through the CLI.

* gradient accumulation: ``train.global_batch_size=4`` in micro-batches of 1 and of 4 gives the same loss,
  gradient norm and held-out loss per step, to rounding;
* the ``lr`` of each ``metrics.jsonl`` record of a warmup + cosine run equals what megatron-core's own
  ``OptimizerParamScheduler`` (the reference, driven as Megatron-LM's loop drives it) gives that step;
* a dense AdamW step skipped for a non-finite gradient is a warning naming the step (not only a
  ``"skipped": true`` in metrics.jsonl);
* every recipe ``megatron-logra recipes`` lists passes config validation;
* bad recipe files (a typo'd key, a wrong type, a missing base, a cycle of bases, a blank ``recipe:``)
  end with ``megatron-logra: error:`` naming the file and the field, exit status 2.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_logra.cli import main
from support.cli import exit_2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

SMALL = ["train.progress=false", "train.eval_sequences=8", "train.eval_interval=0", "--num-layers", "1",
         "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_gradient_accumulation_matches_one_micro_batch_per_step(tmp_path, one_thread):
    runs = {}
    for mbs in (1, 4):
        runs[mbs] = tmp_path / f"mbs{mbs}"
        assert main(["train", "lm-tiny", f"train.run_dir={runs[mbs]}", "train.steps=3", "--global-batch-size", "4",
                     "--micro-batch-size", str(mbs), *SMALL]) == 0
    one, four = _records(runs[1]), _records(runs[4])
    for a, b in zip(one, four, strict=True):
        assert a["loss_tokens"] == b["loss_tokens"] == 4 * 6 and a["tokens"] == b["tokens"] == 4 * 13
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        assert a["clip_coef"] == pytest.approx(b["clip_coef"], rel=1e-6)
    summaries = [json.loads((runs[m] / "summary.json").read_text()) for m in (1, 4)]
    assert summaries[0]["eval_loss_after"] == pytest.approx(summaries[1]["eval_loss_after"], rel=1e-6)
    assert summaries[0]["eval_loss_after"] < summaries[0]["eval_loss_before"]  # it trained


def test_scheduled_lr_of_each_step_is_megatron_cores(tmp_path, one_thread):
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    run, peak, steps = tmp_path / "run", 2e-3, 8
    assert main(["train", "lm-tiny-adam", f"train.run_dir={run}", f"train.steps={steps}", "--lr", str(peak),
                 "--lr-warmup-iters", "2", "--lr-warmup-init", "2e-4", "--lr-decay-style", "cosine",
                 "--lr-decay-iters", "6", "--min-lr", "5e-4", *SMALL]) == 0
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    ref = OptimizerParamScheduler(opt, init_lr=2e-4, max_lr=peak, min_lr=5e-4, lr_warmup_steps=2, lr_decay_steps=6,
                                  lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=6,
                                  wd_incr_style="constant")
    expected = []
    for _ in range(steps):
        expected.append(ref.get_lr(opt.param_groups[0]))
        ref.step(increment=1)  # Megatron-LM advances the scheduler once per successful update
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["skipped"] for r in records] == [False] * steps
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-12)
    assert len(set(expected)) == steps - 1  # warmup, peak, cosine and the floor after decay_steps are all exercised


def test_a_skipped_dense_adamw_step_is_a_warning_naming_it(tmp_path, one_thread, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="megatron_logra.train.lm"):
        assert main(["train", "lm-tiny-adam", f"train.run_dir={run}", "train.steps=3", "--lr", "1e30", *SMALL]) == 0
    skipped = [r["step"] for r in _records(run) if r["skipped"]]
    assert skipped and skipped[-1] == 3  # weights of ±1e30 after step 1: every later gradient is non-finite
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "megatron_logra.train.lm")
    for step in skipped:
        assert f"step {step} skipped (non-finite gradient)" in text


@pytest.mark.parametrize("name", ["tiny", "tiny-adam", "lm-tiny", "lm-tiny-adam", "qwen2.5-1.5b", "qwen2.5-7b", "27b"])
def test_every_listed_recipe_passes_config_validation(name, capsys):
    from megatron_logra.config import RECIPES

    assert name in RECIPES and sorted(RECIPES) == sorted(
        ["tiny", "tiny-adam", "lm-tiny", "lm-tiny-adam", "qwen2.5-1.5b", "qwen2.5-7b", "27b"])
    assert main(["config", name]) in (0, None)
    assert "job:" in capsys.readouterr().out


@pytest.mark.parametrize("text, needles", [
    ("recipe: lm-tiny\ntrain:\n  stpes: 5\n", ["train.stpes", "did you mean train.steps"]),
    ("recipe: lm-tiny\ntrain:\n  steps: five\n", ["train.steps='five'", "not an integer"]),
    ("recipe: lm-tinyy\n", ["unknown recipe 'lm-tinyy'", "did you mean lm-tiny?"]),
    ("recipe: missing.yaml\n", ["missing.yaml does not exist"]),
    ("recipe: other.yaml\n", ["includes itself", "break the cycle"]),
    ("recipe:\ntrain:\n  steps: 5\n", ["'recipe:' is empty", "lm-tiny"]),
    ('recipe: ""\n', ["'recipe:' is empty", "remove the key"]),
    ("recipe: lm-tiny\ntrain:\n\tsteps: 7\n", ["not valid YAML: line 3", "indent with spaces"]),
    ("recipe: lm-tiny\n--lr: 0.1\n", ["key '--lr' starts with '-'", "without the dashes ('lr')"]),
], ids=["typo", "type", "unknown-base", "missing-base", "cycle", "blank-base", "empty-string-base", "tab", "dashes"])
def test_bad_recipe_files_are_refused_naming_the_file_and_field(tmp_path, capsys, text, needles):
    (tmp_path / "other.yaml").write_text("recipe: bad.yaml\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    err = exit_2(["config", str(bad)], capsys)
    assert f"recipe file {bad}" in err
    for needle in needles:
        assert needle in err

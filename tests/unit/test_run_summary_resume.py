"""The LM job's ``summary.json`` describes the whole run, also after ``--resume`` (the steps, first and last
loss of every process, read back from ``metrics.jsonl``; the held-out loss before step 1), and a resume with
nothing left to train rewrites the same whole-run summary. A new LM or RL run in a used run directory
(``train.overwrite=true``) leaves none of the old run's outputs (plot, summary, metrics, TensorBoard events,
checkpoints, tokenizer, sync deltas) beside its own, and one without ``train.overwrite`` is refused while they
are there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.cli import main

SMALL = ["train.progress=false", "train.eval_sequences=16", "train.eval_interval=0", "train.save_interval=0",
         "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]

WHOLE_RUN = ("optimizer", "first_loss", "last_loss", "eval_loss_before", "eval_loss_after", "chance_loss", "steps",
             "stopped")
"""Summary fields that describe the run, whichever process wrote the summary."""


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _train(capsys, run: Path, *args: str) -> dict:
    """``megatron-logra train ARGS`` of the run in ``run``; the printed summary, checked equal to the
    ``summary.json`` written."""
    assert main(["train", *args]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads((run / "summary.json").read_text()) == printed
    return printed


def _files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}


def test_a_resumed_runs_summary_covers_every_step_and_a_no_op_resume_keeps_it(tmp_path, capsys, one_thread):
    run = tmp_path / "run"
    first = _train(capsys, run, "lm-tiny", f"train.run_dir={run}", "train.steps=2", *SMALL)
    records = _records(run)
    assert (first["steps"], first["first_loss"], first["last_loss"]) == (2, records[1]["loss"], records[2]["loss"])
    assert first["eval_loss_before"] is not None

    resumed = _train(capsys, run, "--resume", str(run), "train.steps=3")
    records = _records(run)
    assert sorted(records) == [1, 2, 3]
    assert (resumed["steps"], resumed["first_loss"], resumed["last_loss"]) == (3, records[1]["loss"],
                                                                               records[3]["loss"])
    assert resumed["eval_loss_before"] == first["eval_loss_before"]  # before step 1, not before step 3

    again = _train(capsys, run, "--resume", str(run))  # at train.steps already: nothing to train
    assert _records(run) == records
    assert {k: again[k] for k in WHOLE_RUN} == pytest.approx({k: resumed[k] for k in WHOLE_RUN})

    # what each process did itself
    assert [(s["resumed_from_step"], s["segment_steps"]) for s in (first, resumed, again)] == [(0, 2), (2, 1), (3, 0)]
    assert first["segment_eval_loss_before"] == first["eval_loss_before"]
    assert resumed["segment_eval_loss_before"] == pytest.approx(first["eval_loss_after"])  # at the checkpoint
    assert again["segment_eval_loss_before"] == pytest.approx(resumed["eval_loss_after"])


def test_a_resume_after_a_killed_process_reads_the_losses_it_recorded(tmp_path, capsys, one_thread):
    """An earlier process that ended without a summary (killed after its checkpoint): the whole-run losses
    still come from ``metrics.jsonl``; the held-out loss before step 1 from ``eval_before.json``, which that
    process wrote as soon as it measured it; without that file too it is unknown (null), not this process's."""
    run = tmp_path / "run"
    first = _train(capsys, run, "lm-tiny", f"train.run_dir={run}", "train.steps=2", *SMALL)
    (run / "summary.json").unlink()
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3, "loss": 0.')  # the torn record of a step that never reached a checkpoint
    resumed = _train(capsys, run, "--resume", str(run), "train.steps=3")
    records = _records(run)
    assert (resumed["first_loss"], resumed["last_loss"], resumed["steps"]) == (records[1]["loss"],
                                                                                records[3]["loss"], 3)
    assert resumed["eval_loss_before"] == first["eval_loss_before"] is not None
    assert resumed["segment_eval_loss_before"] is not None
    assert resumed["segment_eval_loss_before"] != first["eval_loss_before"]  # this process's: after 2 steps
    (run / "summary.json").unlink()
    (run / "eval_before.json").unlink()
    again = _train(capsys, run, "--resume", str(run), "train.steps=4")
    assert again["eval_loss_before"] is None and again["segment_eval_loss_before"] is not None


def test_overwrite_leaves_nothing_of_the_previous_run(tmp_path, capsys, one_thread):
    from megatron_logra.plot import plot_run

    run = tmp_path / "run"
    _train(capsys, run, "lm-tiny", f"train.run_dir={run}", "train.steps=2", *SMALL)
    plot_run(run)
    (run / "tokenizer").mkdir()  # as an RL run leaves it
    (run / "tokenizer" / "tokenizer.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    old = _files(run)
    assert "summary.png" in old and any(name.startswith("tensorboard/") for name in old)

    with pytest.raises(SystemExit) as exit_:  # a new run without train.overwrite: refused, nothing touched
        main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=1", *SMALL])
    assert exit_.value.code == 2 and "already holds a run" in capsys.readouterr().err
    assert _files(run) == old

    summary = _train(capsys, run, "lm-tiny", f"train.run_dir={run}", "train.steps=1", "train.overwrite=true", *SMALL)
    assert (run / "notes.txt").read_text() == "mine"
    rewritten = {"notes.txt", "config.yaml", "metrics.jsonl", "summary.json", "checkpoints/latest", "eval_before.json"}
    assert sorted(name for name in old - rewritten if (run / name).exists()) == []  # plot, events, checkpoints, ...
    assert json.loads((run / "eval_before.json").read_text()) == {"eval_loss_before": summary["eval_loss_before"]}
    assert not (run / "tokenizer").exists() and any(name.startswith("tensorboard/") for name in _files(run))
    assert sorted(_records(run)) == [1] and summary["steps"] == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000001"]


RL_SMALL = ["rl.steps=1", "train.progress=false", "rl.prompts_per_step=2", "rl.group_size=4", "rl.eval_interval=0",
            "task.num_eval=4", "train.save_interval=0"]


def test_overwrite_of_an_rl_run_leaves_nothing_of_the_previous_run(tmp_path, capsys, one_thread):
    """The RL job: the old run's plot, TensorBoard events, checkpoint and tokenizer files are gone after
    ``train.overwrite=true`` (the same step's checkpoint and the tokenizer are written anew, not merged)."""
    import warnings

    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.plot import plot_run

    run = tmp_path / "run"

    def train(*extra: str) -> dict:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return _train(capsys, run, "tiny", f"train.run_dir={run}", *RL_SMALL, *extra)
        finally:
            destroy_parallel()

    train()
    plot_run(run)
    for stale in ("checkpoints/step_00000001/stale", "tokenizer/stale.json", "deltas/rank0/stale"):
        (run / stale).parent.mkdir(parents=True, exist_ok=True)
        (run / stale).write_text("old run")
    old = _files(run)
    assert "summary.png" in old and any(name.startswith("tensorboard/") for name in old)

    summary = train("train.overwrite=true")
    rewritten = {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints/latest", "eval_before.json"}
    survivors = [name for name in old - rewritten if (run / name).exists()]
    assert json.loads((run / "eval_before.json").read_text()) == {
        "eval_accuracy_before": summary["eval_accuracy_before"]}
    assert all(name.startswith(("checkpoints/step_00000001/", "tokenizer/")) for name in survivors), survivors
    assert [name for name in survivors if name.endswith("stale") or name.endswith("stale.json")] == []
    assert not (run / "summary.png").exists() and not (run / "deltas").exists()
    assert any((run / "tokenizer").iterdir()) and summary["steps"] == 1
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1]


def test_a_plot_alone_counts_as_a_previous_run(tmp_path, capsys):
    """A directory holding only a previous run's ``summary.png`` (its metrics and checkpoints deleted) is
    refused too: a new run would otherwise finish beside a plot that is not its own."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.png").write_bytes(b"\x89PNG old")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=1", *SMALL])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "summary.png" in err and "train.overwrite=true" in err
    assert (run / "summary.png").read_bytes() == b"\x89PNG old"

"""A step that applied no update (``skipped``, ``skip_reason`` in ``metrics.jsonl``) is visible where users look:
TensorBoard gets ``skipped`` as a 0/1 series and the reason as text at that step, and ``megatron-logra plot``
marks the step on the step-size panel instead of leaving an unexplained gap in α."""

from __future__ import annotations

import json

import pytest

import megatron_logra.plot as plot
from megatron_logra.metrics import MetricsWriter


def _records() -> list[dict]:
    out = []
    for step in range(1, 7):
        skipped = step in (3, 5)
        out.append({"step": step, "reward_mean": 0.1 * step, "accuracy": 0.1, "kl_predicted": None if skipped else 1e-3,
                    "kl_actual": None if skipped else 1.1e-3, "alpha": None if skipped else 0.5 + step,
                    "skipped": skipped, "skip_reason": ("zero advantages" if step == 3 else "non-finite gradient")
                    if skipped else None, "sync_mode": "delta"})
    return out


def test_tensorboard_gets_the_skipped_flag_and_the_reason(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("torch.utils.tensorboard")
    w = MetricsWriter(tmp_path)
    for record in _records():
        w.write(record)
    w.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"),
                                             size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    flags = [(e.step, e.value) for e in acc.Scalars("skipped")]
    assert flags == [(s, 1.0 if s in (3, 5) else 0.0) for s in range(1, 7)]
    assert [e.step for e in acc.Scalars("alpha")] == [1, 2, 4, 6]
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("skip_reason/text_summary")}
    assert texts == {3: "zero advantages", 5: "non-finite gradient"}
    assert "sync_mode/text_summary" not in acc.Tags()["tensors"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skip_reason"] for r in lines] == [r["skip_reason"] for r in _records()]


def _alpha_axis(fig):
    return next(ax for ax in fig.axes if ax.get_title() == "step size α")


def test_plot_marks_the_skipped_steps_on_the_step_size_panel():
    fig = plot.summary_figure(_records())
    ax = _alpha_axis(fig)
    marks = [line for line in ax.get_lines() if line.get_label().startswith("no update")]
    assert len(marks) == 1 and marks[0].get_label() == "no update (2 steps)"
    assert list(marks[0].get_xdata()) == [3, 5]
    alpha = next(line for line in ax.get_lines() if line.get_label() == "α")
    assert list(alpha.get_xdata()) == [1, 2, 4, 6]
    assert ax.get_legend() is not None


def test_a_run_whose_every_step_was_skipped_still_shows_the_panel():
    records = [dict(r, alpha=None, skipped=True, skip_reason="zero advantages") for r in _records()]
    fig = plot.summary_figure(records)
    marks = _alpha_axis(fig).get_lines()
    assert [line.get_label() for line in marks] == ["no update (6 steps)"]


def test_no_mark_without_skipped_steps():
    records = [dict(r, alpha=1.0, skipped=False, skip_reason=None) for r in _records()]
    ax = _alpha_axis(plot.summary_figure(records))
    assert [line.get_label() for line in ax.get_lines()] == ["α"]
    assert ax.get_legend() is None

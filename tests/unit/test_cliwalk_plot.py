"""``megatron-logra plot`` on the runs a user has: the figure's curves are read back from the matplotlib
lines and compared with the numbers written into ``metrics.jsonl`` / ``summary.json`` here.

* the final held-out value that a run records in ``summary.json`` only (an lm run whose last step is no
  multiple of ``train.eval_interval``, an RL run with ``rl.eval_interval=0``) ends the held-out curve;
* a run evaluated on several sources (``task.eval_datasets``) gets a held-out curve per source;
* NaN / Infinity in a hand-edited file are no value (no line, no legend entry for them);
* a run stopped before its first step is named as such, not as "not a run directory".
"""

from __future__ import annotations

import json
import math

import pytest

import megatron_logra.plot as plot
from megatron_logra.cli import main


@pytest.fixture
def lines(monkeypatch):
    """label -> (xs, ys) of every line plot_run drew (twin axes included); the file is still written."""
    seen: dict[str, tuple[list, list]] = {}
    real = plot.save_figure

    def spy(fig, path, **kwargs):
        for ax in fig.axes:
            for line in ax.get_lines():
                seen[line.get_label()] = ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
        return real(fig, path, **kwargs)

    monkeypatch.setattr(plot, "save_figure", spy)
    return seen


def _run(tmp_path, records, summary=None, raw=None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("job: rl\n")
    text = raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(text)
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def _lm(step, loss, eval_loss=None):
    return {"step": step, "loss": loss, "grad_norm": 1.0 + step, "tokens_per_second": 100.0 * step,
            "eval_loss": eval_loss}


def _rl(step, **extra):
    return {"step": step, "reward_mean": 0.1 * step, "accuracy": 0.05 * step, "eval_accuracy": None,
            "kl_predicted": 1e-3, "kl_actual": 2e-3, "budget": 2e-3, "alpha": 1.0 + step,
            "update_ratio": 1e-3 * step, "memory_bytes": 2**20 * (100 + step), **extra}


def test_the_final_held_out_loss_of_summary_ends_the_lm_curve(tmp_path, lines):
    records = [_lm(s, 4.0 - 0.3 * s) for s in range(1, 7)]  # train.eval_interval=50 > 6 steps: all null
    run = _run(tmp_path, records, {"steps": 6, "stopped": None, "eval_loss_before": 3.75, "eval_loss_after": 2.25})
    plot.plot_run(run)
    assert lines["held-out"] == ([0.0, 6.0], [3.75, 2.25])
    assert lines["train"] == ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [4.0 - 0.3 * s for s in range(1, 7)])


def test_an_rl_run_without_interval_evaluations_shows_before_and_after(tmp_path, lines):
    records = [_rl(s) for s in (1, 2, 3)]  # rl.eval_interval=0: no record has a held-out value
    run = _run(tmp_path, records, {"steps": 3, "stopped": None, "eval_accuracy_before": 0.035,
                                   "eval_accuracy_after": 0.125})
    plot.plot_run(run)
    assert lines["held-out accuracy"] == ([0.0, 3.0], [0.035, 0.125])


def test_a_recorded_final_value_is_kept_and_a_stale_summary_is_not_used(tmp_path, lines):
    records = [_rl(1), _rl(2, eval_accuracy=0.5)]
    run = _run(tmp_path, records, {"steps": 2, "stopped": None, "eval_accuracy_after": 0.75})
    plot.plot_run(run)
    assert lines["held-out accuracy"] == ([2.0], [0.5])  # the record's own value wins
    (run / "summary.json").write_text(json.dumps({"steps": 1, "stopped": None, "eval_accuracy_after": 0.75}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [_rl(1), _rl(2), _rl(3)]))
    lines.clear()
    plot.plot_run(run)  # the summary of an earlier segment (step 1), the records go on to step 3
    assert "held-out accuracy" not in lines


def test_each_benchmark_gets_its_own_held_out_curve(tmp_path, lines):
    a, b = "eval_accuracy/chain_sum", "eval_accuracy/jsonl:b.jsonl"
    records = [_rl(1), _rl(2, eval_accuracy=0.1, **{a: 0.05, b: 0.6}), _rl(3)]
    run = _run(tmp_path, records, {"steps": 3, "stopped": None, "eval_accuracy_after": 0.2,
                                   "eval_accuracy_after/chain_sum": 0.15, "eval_accuracy_after/jsonl:b.jsonl": 0.7})
    plot.plot_run(run)
    assert lines["held-out chain_sum"] == ([2.0, 3.0], [0.05, 0.15])
    assert lines["held-out jsonl:b.jsonl"] == ([2.0, 3.0], [0.6, 0.7])
    assert lines["held-out accuracy (all)"] == ([2.0, 3.0], [0.1, 0.2])


def test_a_single_source_draws_no_duplicate_curve(tmp_path, lines):
    records = [_rl(1, eval_accuracy=0.25, **{"eval_accuracy/chain_sum": 0.25})]
    plot.plot_run(_run(tmp_path, records))
    assert lines["held-out accuracy"] == ([1.0], [0.25])
    assert not [label for label in lines if "chain_sum" in label]


def test_nan_and_infinity_are_no_value(tmp_path, lines):
    records = [_rl(s) for s in (1, 2, 3)]
    records[1]["kl_actual"] = float("nan")
    for r in records:
        r["alpha"] = float("inf")
    raw = "".join(json.dumps(r) + "\n" for r in records)  # Python writes NaN / Infinity
    assert "NaN" in raw and "Infinity" in raw
    plot.plot_run(_run(tmp_path, records, raw=raw))
    assert lines["actual KL"] == ([1.0, 3.0], [2e-3, 2e-3])
    assert "α" not in lines  # no finite α anywhere: no line, no legend entry
    assert all(math.isfinite(y) for _, ys in lines.values() for y in ys)


def test_a_run_stopped_before_its_first_step_is_named_so(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("job: rl\n")
    with pytest.raises(SystemExit) as exc:
        main(["plot", str(run)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "recorded no step" in err and "is it a run directory" not in err
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit):
        main(["plot", str(run)])
    assert "recorded no step" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SystemExit):
        main(["plot", str(other)])
    assert "a run directory?" in capsys.readouterr().err

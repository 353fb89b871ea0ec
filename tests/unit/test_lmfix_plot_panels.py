"""``megatron-logra plot`` draws only the panels with data for the run's job, without warnings: an LM run
shows its loss, gradient norm and throughput (no empty RL panels, no empty legend)."""

from __future__ import annotations

import json
import warnings

import pytest

import megatron_logra.plot as plot
from megatron_logra.cli import main

LM_SMALL = ["train.progress=false", "train.eval_sequences=4", "train.save_interval=0",
            "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


@pytest.fixture
def drawn(monkeypatch):
    """What plot_run drew: for each visible axis (title, lines plotted on it and its twins, legend shown);
    the real save_figure still writes the file."""
    seen: list[list[tuple]] = []
    real = plot.save_figure

    def spy(fig, path, **kwargs):
        axes = [ax for ax in fig.axes if ax.get_visible()]
        titled = [ax for ax in axes if ax.get_title()]
        info = []
        for ax in titled:
            twins = [t for t in axes if t is not ax and not t.get_title() and t.bbox.bounds == ax.bbox.bounds]
            info.append((ax.get_title(), len(ax.get_lines()) + sum(len(t.get_lines()) for t in twins),
                         ax.get_legend() is not None))
        seen.append(info)
        return real(fig, path, **kwargs)

    monkeypatch.setattr(plot, "save_figure", spy)
    return seen


def _plot_quietly(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = plot.plot_run(run)
    assert not caught, [str(w.message) for w in caught]
    assert out.stat().st_size > 0


def test_an_lm_run_draws_its_own_panels_only(tmp_path, capsys, one_thread, drawn):
    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=4", "train.eval_interval=2",
                 *LM_SMALL]) == 0
    capsys.readouterr()
    _plot_quietly(run)
    (panels,) = drawn
    assert [title for title, _, _ in panels] == ["loss per answer token", "gradient norm (before clipping)",
                                                 "throughput"]
    assert all(lines >= 1 for _, lines, _ in panels)
    assert panels[0][1:] == (2, True)  # train and held-out loss, with a legend; the others have one series each
    assert [legend for _, _, legend in panels[1:]] == [False, False]


def _rl_record(step: int, **extra) -> dict:
    record = {"step": step, "reward_mean": 0.1 * step, "accuracy": 0.1, "eval_accuracy": None,
              "kl_predicted": 1e-3, "kl_actual": 2e-3, "budget": 1e-3, "alpha": 0.5, "update_ratio": 1e-4,
              "memory_bytes": 2**30, "gpu_memory_peak_bytes": None, "gpu_memory_reserved_peak_bytes": None}
    record.update(extra)
    return record


@pytest.mark.parametrize("extra, titles", [
    ({}, ["reward and accuracy", "KL per update", "step size α", "process memory (RSS)"]),
    # dense AdamW: no KL; no psutil: RSS recorded as 0; on a GPU the memory peaks
    ({"kl_predicted": None, "kl_actual": None, "budget": None, "memory_bytes": 0,
      "gpu_memory_peak_bytes": 3 * 2**30, "gpu_memory_reserved_peak_bytes": 4 * 2**30},
     ["reward and accuracy", "step size α", "GPU memory peak"]),
])
def test_an_rl_run_draws_the_panels_with_data(tmp_path, drawn, extra, titles):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(_rl_record(s, **extra)) + "\n" for s in (1, 2, 3)))
    _plot_quietly(run)
    (panels,) = drawn
    assert [title for title, _, _ in panels] == titles
    assert all(lines >= 1 for _, lines, _ in panels)


def test_records_with_nothing_to_plot_are_an_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": None}) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: no step record has a value to plot"):
        plot.plot_run(run)


def test_pass_at_k_is_drawn_beside_held_out_accuracy(tmp_path, drawn):
    run = tmp_path / "run"
    run.mkdir()
    records = [_rl_record(s, eval_accuracy=0.2 * s, eval_pass_at_k=0.3 * s) for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _plot_quietly(run)
    (panels,) = drawn
    assert panels[0] == ("reward and accuracy", 4, True)  # reward, train and held-out accuracy, pass@k

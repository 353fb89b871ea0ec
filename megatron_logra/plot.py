"""``megatron-logra plot RUN_DIR``: one PNG summarising a run from its ``metrics.jsonl``.

Only panels with data are drawn, in a grid of two columns (one for a single panel). An RL run (its
records carry ``reward_mean``): reward and accuracy (train and held-out), predicted vs actual KL per
update with the budget, step size α (and ‖ΔW‖/‖W‖), process memory (RSS) and, on GPUs, the memory
peaks. An lm run: train and held-out loss, gradient norm, throughput (tokens processed per second)
and, on GPUs, the memory peaks. A legend is drawn only for a panel with several series. The held-out
curve starts at step 0 with the value before training that the run's ``summary.json`` holds
(``eval_accuracy_before`` / ``eval_loss_before``: the whole run's, also after ``--resume``), when it does,
and ends with the final evaluation's value (``eval_*_after``) when the last step's record has none. A run
evaluated on several sources (``task.eval_datasets``, a task mixture) also gets a held-out curve per source.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from megatron_logra.plot_records import finite_series, held_out_after, held_out_before

logger = logging.getLogger(__name__)

__all__ = ["held_out_after", "held_out_before", "read_metrics", "plot_run", "pyplot", "save_figure", "summary_figure"]


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (cluster nodes have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, *, dpi: Optional[float] = None) -> Path:
    """Lay ``fig`` out, write it to ``path`` (creating the folder), close it and return the path written:
    ``path`` with ``.png`` appended when its suffix is not an image format matplotlib writes."""
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lstrip(".").lower() not in fig.canvas.get_supported_filetypes():
        path = path.with_name(path.name + ".png")  # what is written (matplotlib adds .png only without a suffix)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The step records of a run; a clear error when the run has none. A torn final line (no newline at the
    end of the file and not JSON: the run was killed, or its disk filled, while writing it) is dropped with a
    warning, as ``--resume`` drops it; any other line that is not a step record is an error naming the file
    and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if Path(run_dir).is_file():
        raise FileNotFoundError(f"{run_dir} is a file, not a run directory: give the folder holding "
                                f"metrics.jsonl ({Path(run_dir).parent})")
    started = (Path(run_dir) / "config.yaml").is_file()  # a run's folder, metrics or not
    if not path.exists():
        if started:
            raise FileNotFoundError(f"{path} does not exist: the run in {run_dir} has recorded no step (it stopped, "
                                    f"or is still starting, before its first step); plot it once it has one")
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                logger.warning("%s:%d: dropping a torn last record (the run was killed while writing it): %s",
                               path, lineno, line.strip()[:60])
                continue
            raise ValueError(f"{path}:{lineno} is not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno} is not a JSON object (a step record), got a "
                             f"{type(record).__name__}: {line.strip()[:60]}")
        step = record.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            raise ValueError(f"{path}:{lineno} has no numeric 'step' (got {step!r}); is this a run's metrics file?")
        records.append(record)
    if not records:
        raise ValueError(f"{path} has no records" + (": the run has recorded no step (it stopped, or is still "
                                                      "starting, before its first step)" if started else ""))
    return records


def _lines(ax, records: list[dict], series, scale: float = 1.0) -> None:
    """Plot each ``(key, label, style)`` of ``series`` that has values (times ``scale``); a legend when
    several were drawn."""
    drawn = 0
    for key, label, style in series:
        xs, ys = finite_series(records, key)
        if xs:
            ax.plot(xs, [y * scale for y in ys], label=label, **style)
            drawn += 1
    if drawn > 1:
        ax.legend()


def _sources(records: list[dict]) -> list[str]:
    """The held-out sources that the records report one by one (``eval_accuracy/NAME``: the benchmarks of
    ``task.eval_datasets`` or the sources of a task mixture), in the order they first appear."""
    names: dict[str, None] = {}
    for r in records:
        names.update((k, None) for k in r if k.startswith("eval_accuracy/"))
    return list(names)


def _panel_rl_reward(ax, records) -> None:
    ax.set_title("reward and accuracy")
    sources = _sources(records)
    by_source = [(k, f"held-out {k.split('/', 1)[1]}", {"marker": ".", "linestyle": "--"})
                 for k in sources] if len(sources) > 1 else []  # one source: the same values as held-out accuracy
    _lines(ax, records, [("reward_mean", "reward", {}), ("accuracy", "train accuracy", {}),
                         ("eval_accuracy", "held-out accuracy" + (" (all)" if by_source else ""), {"marker": "o"}),
                         *by_source,
                         ("eval_pass_at_k", "held-out pass@k", {"marker": "^", "linestyle": ":"})])


def _panel_rl_kl(ax, records) -> None:
    ax.set_title("KL per update")
    _lines(ax, records, [("kl_predicted", "predicted KL", {}), ("kl_actual", "actual KL", {}),
                         ("budget", "budget", {"linestyle": "--"})])
    if any(y > 0 for y in finite_series(records, "kl_actual")[1]):
        ax.set_yscale("log")


def _skipped_steps(records: list[dict]) -> list[int]:
    """The steps whose record says ``skipped``: no update applied (zero advantages, a refused update)."""
    return [r["step"] for r in records if r.get("skipped") is True]


def _panel_rl_alpha(ax, records) -> None:
    ax.set_title("step size α")
    _lines(ax, records, [("alpha", "α", {})])
    skipped = _skipped_steps(records)
    if skipped:  # α has no value there: a mark on the axis shows the gap is a skipped update, not missing data
        ax.plot(skipped, [0.0] * len(skipped), linestyle="none", marker="x", color="tab:red",
                label=f"no update ({len(skipped)} step{'s' if len(skipped) > 1 else ''})", clip_on=False)
    ax.set_ylabel("α")
    xs, ys = finite_series(records, "update_ratio")
    if xs:
        ax2 = ax.twinx()
        ax2.plot(xs, ys, color="tab:orange", label="‖ΔW‖/‖W‖")
        ax2.set_ylabel("‖ΔW‖/‖W‖ (right axis)")
        lines = ax.get_lines() + ax2.get_lines()
        if len(lines) > 1:  # two axes: one legend naming both series
            ax2.legend(lines, [line.get_label() for line in lines])
    elif len(ax.get_lines()) > 1:
        ax.legend()


def _panel_rss(ax, records) -> None:
    ax.set_title("process memory (RSS)")
    ax.set_ylabel("MiB")
    # 0 is what the RL job records without psutil: no measurement
    _lines(ax, [r for r in records if r.get("memory_bytes")], [("memory_bytes", "RSS", {})], 1 / 2**20)


def _panel_gpu_memory(ax, records) -> None:
    ax.set_title("GPU memory peak")
    ax.set_ylabel("GiB")
    _lines(ax, records, [("gpu_memory_peak_bytes", "tensors", {}),
                         ("gpu_memory_reserved_peak_bytes", "reserved", {"linestyle": "--"})], 1 / 2**30)


def _panel_lm_loss(ax, records) -> None:
    ax.set_title("loss per answer token")
    _lines(ax, records, [("loss", "train", {}), ("eval_loss", "held-out", {"marker": "o"})])


def _panel_lm_grad_norm(ax, records) -> None:
    ax.set_title("gradient norm (before clipping)")
    _lines(ax, records, [("grad_norm", "grad norm", {})])


def _panel_lm_throughput(ax, records) -> None:
    ax.set_title("throughput")
    ax.set_ylabel("tokens processed / s")
    _lines(ax, records, [("tokens_per_second", "tokens/s", {})])


def _has_data(records: list[dict], keys: tuple[str, ...]) -> bool:
    if "skipped" in keys and _skipped_steps(records):
        return True
    # memory_bytes 0 is what the RL job records without psutil: no measurement
    return any(finite_series([r for r in records if key != "memory_bytes" or r.get(key)], key)[0] for key in keys)


_RL_PANELS = (
    (_panel_rl_reward, ("reward_mean", "accuracy", "eval_accuracy")),
    (_panel_rl_kl, ("kl_predicted", "kl_actual", "budget")),
    (_panel_rl_alpha, ("alpha", "update_ratio", "skipped")),
    (_panel_rss, ("memory_bytes",)),
    (_panel_gpu_memory, ("gpu_memory_peak_bytes", "gpu_memory_reserved_peak_bytes")),
)
_LM_PANELS = (
    (_panel_lm_loss, ("loss", "eval_loss")),
    (_panel_lm_grad_norm, ("grad_norm",)),
    (_panel_lm_throughput, ("tokens_per_second",)),
    (_panel_gpu_memory, ("gpu_memory_peak_bytes", "gpu_memory_reserved_peak_bytes")),
)
"""Each job's panels: (draw on an axis, the fields it plots); a panel is drawn when a field has a value."""


def summary_figure(records: list[dict], title: str = ""):
    """The summary figure of ``records`` (a run's step records): the panels of the run's job (RL when a record
    has ``reward_mean``, else lm) that have data, two per row; ``ValueError`` when none has any."""
    plt = pyplot()
    rl = any("reward_mean" in r for r in records)
    panels = _RL_PANELS if rl else _LM_PANELS
    with_data = [draw for draw, keys in panels if _has_data(records, keys)]
    if not with_data:
        fields = sorted({key for _, keys in panels for key in keys})
        raise ValueError(f"no step record has a value to plot (fields plotted: {', '.join(fields)})")
    ncols = 1 if len(with_data) == 1 else 2
    nrows = -(-len(with_data) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.75 * nrows), squeeze=False)
    flat = list(axes.flat)
    from matplotlib.ticker import MaxNLocator

    for panel, ax in zip(with_data, flat):
        panel(ax, records)
        ax.set_xlabel("update" if rl else "step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also on short runs
    for ax in flat[len(with_data):]:
        fig.delaxes(ax)
    if title:
        fig.suptitle(title)
    return fig


def plot_run(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Write the summary PNG (default ``RUN_DIR/summary.png``; :func:`summary_figure` of the step records,
    preceded by :func:`held_out_before`'s step-0 record when there is one, the last one completed by
    :func:`held_out_after`) and return its path."""
    records = read_metrics(run_dir)
    after = held_out_after(run_dir, records)
    if after:
        records = [*records[:-1], {**records[-1], **after}]
    before = held_out_before(run_dir, records)
    if before is not None:
        records = [before, *records]
    if out and (str(out).endswith(("/", os.sep)) or Path(out).is_dir()):  # a folder: the figure goes in it
        out = Path(out) / "summary.png"
    out = Path(out) if out else Path(run_dir) / "summary.png"
    try:
        fig = summary_figure(records, str(run_dir))
    except ValueError as exc:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'}: {exc}") from None
    out = save_figure(fig, out, dpi=110)
    logger.info("wrote %s", out)
    return out

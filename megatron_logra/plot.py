"""``megatron-logra plot RUN_DIR``: one PNG summarising a run from its ``metrics.jsonl``.

Panels: reward and accuracy (train and held-out), predicted vs actual KL per update, step
size α with the KL budget, and process memory. An lm run shows its loss instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["read_metrics", "plot_run", "pyplot", "save_figure"]


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
    if not path.exists():
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
        raise ValueError(f"{path} has no records")
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_run(run_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Write the summary PNG (default ``RUN_DIR/summary.png``) and return its path."""
    plt = pyplot()
    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "summary.png"
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0, 0]
    if any("reward_mean" in r for r in records):
        for key, label in (("reward_mean", "reward"), ("accuracy", "train accuracy"), ("eval_accuracy", "held-out accuracy")):
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if key == "eval_accuracy" else None, label=label)
        ax.set_title("reward and accuracy")
    else:
        for key in ("loss", "eval_loss"):
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, label=key)
        ax.set_title("loss")
    ax.legend()
    ax = axes[0, 1]
    for key, label in (("kl_predicted", "predicted KL"), ("kl_actual", "actual KL"), ("budget", "budget")):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=label, linestyle="--" if key == "budget" else "-")
    ax.set_yscale("log") if any(_series(records, "kl_actual")[1]) else None
    ax.set_title("KL per update")
    ax.legend()
    ax = axes[1, 0]
    xs, ys = _series(records, "alpha")
    if xs:
        ax.plot(xs, ys, label="α")
    xs, ys = _series(records, "update_ratio")
    if xs:
        ax2 = ax.twinx()
        ax2.plot(xs, ys, color="tab:orange", label="‖ΔW‖/‖W‖")
        ax2.set_ylabel("‖ΔW‖/‖W‖")
    ax.set_title("step size α")
    ax = axes[1, 1]
    xs, ys = _series(records, "memory_bytes")
    if xs:
        ax.plot(xs, [y / 2**20 for y in ys])
        ax.set_ylabel("MiB")
    ax.set_title("process memory (RSS)")
    for a in axes.flat:
        a.set_xlabel("update")
    fig.suptitle(str(run_dir))
    out = save_figure(fig, out, dpi=110)
    logger.info("wrote %s", out)
    return out

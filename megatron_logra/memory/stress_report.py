"""Readings of ``tools/memory_stress.py``: the CSV columns, the NVML sampler, the table and the plot."""

from __future__ import annotations

import csv
import logging
import threading
from pathlib import Path

import torch

from megatron_logra.plot import pyplot, save_figure

__all__ = ["COLUMNS", "MEASURED", "GiB", "NvmlSampler", "unit_of", "fmt", "report", "plot"]

logger = logging.getLogger("memory_stress")

COLUMNS = ["optimizer", "step", "device", "world", "tp", "tokens_per_step", "peak_allocated_bytes",
           "peak_reserved_bytes", "nvml_peak_used_bytes", "live_tensor_peak_bytes", "peak_rss_bytes",
           "optimizer_state_bytes", "predicted_peak_bytes", "predicted_optimizer_state_bytes", "step_seconds", "loss"]
MEASURED = COLUMNS[6:12] + ["step_seconds"]
GiB = 2 ** 30


class NvmlSampler:
    """Peak device memory in use during a region, sampled every ``interval`` s (None without NVML)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.handle, self.interval, self.peak = None, interval, None
        try:
            import pynvml
        except ImportError:
            logger.warning("nvidia-ml-py (pynvml) is not installed: no NVML readings (pip install nvidia-ml-py)")
            return
        try:
            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            try:  # by PCI id: CUDA_VISIBLE_DEVICES renumbers CUDA devices, not NVML's
                pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci.encode())
            except (AttributeError, pynvml.NVMLError):
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self._info = pynvml.nvmlDeviceGetMemoryInfo
        except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound without a driver, and friends
            logger.warning("NVML unavailable (%s): no NVML readings", exc)
            self.handle = None

    def __enter__(self):
        self.peak, self._stop = None, threading.Event()
        if self.handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            used = self._info(self.handle).used
            self.peak = used if self.peak is None else max(self.peak, used)
            if self._stop.wait(self.interval):
                return

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self._stop.set()
            self._thread.join()


def unit_of(rows: list[dict]) -> tuple[str, int]:
    """GiB when any reading reaches 1 GiB, else MiB."""
    keys = [k for k in COLUMNS if k.endswith("_bytes")]
    big = max((r[k] for r in rows for k in keys if r.get(k) is not None), default=0)
    return ("GiB", GiB) if big >= GiB else ("MiB", 2 ** 20)


def fmt(v, scale: int) -> str:
    return "-" if v in (None, "") else f"{int(v) / scale:.3f}"


def report(rows: list[dict], out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "memory_stress.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})
    unit, scale = unit_of(rows)
    head = ["optimizer", "step", "allocated", "reserved", "NVML used", "live tensors", "RSS", "predicted peak",
            "opt state", "predicted opt state", "step s"]
    print(f"{title}\n(peaks per step, worst rank, {unit})")
    print(" | ".join(head))
    keys = ["peak_allocated_bytes", "peak_reserved_bytes", "nvml_peak_used_bytes", "live_tensor_peak_bytes",
            "peak_rss_bytes", "predicted_peak_bytes", "optimizer_state_bytes", "predicted_optimizer_state_bytes"]
    for r in rows:
        print(" | ".join([r["optimizer"], str(r["step"]), *(fmt(r.get(k), scale) for k in keys),
                          "-" if r.get("step_seconds") is None else f"{r['step_seconds']:.2f}"]))
    plot(rows, out / "memory_stress.png", title)
    print(f"wrote {out / 'memory_stress.csv'} and {out / 'memory_stress.png'}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()

    unit, scale = unit_of(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_rss = None
    kinds = list(dict.fromkeys(r["optimizer"] for r in rows))
    series = (("peak_allocated_bytes", "-o", "allocated"), ("peak_reserved_bytes", "--s", "reserved"),
              ("nvml_peak_used_bytes", ":^", "NVML used"), ("live_tensor_peak_bytes", "-o", "live tensors"),
              ("peak_rss_bytes", ":s", "process RSS (right axis)"))
    for i, kind in enumerate(kinds):
        rs, colour = [r for r in rows if r["optimizer"] == kind], f"C{i}"
        for key, style, what in series:
            pts = [(r["step"], r[key] / scale) for r in rs if r.get(key) is not None]
            if pts:  # RSS is the whole process, imports included: its own axis
                ax = (ax_rss := ax_rss or ax1.twinx()) if key == "peak_rss_bytes" else ax1
                ax.plot(*zip(*pts), style, color=colour, label=f"{kind} {what}")
        ax1.axhline(rs[0]["predicted_peak_bytes"] / scale, color=colour, alpha=0.5, lw=1, label=f"{kind} predicted")
        ax2.bar(i - 0.2, (rs[-1].get("optimizer_state_bytes") or 0) / scale, 0.4, color=colour,
                label="measured" if i == 0 else None)
        ax2.bar(i + 0.2, rs[0]["predicted_optimizer_state_bytes"] / scale, 0.4, color=colour, alpha=0.4,
                hatch="//", label="predicted" if i == 0 else None)
    ax1.set(xlabel="step", ylabel=f"{unit} (worst rank)", title="peak memory per step", ylim=(0, None))
    ax1.xaxis.get_major_locator().set_params(integer=True)
    handles, labels = ax1.get_legend_handles_labels()
    if ax_rss is not None:
        ax_rss.set_ylabel(f"process RSS {unit}")
        handles, labels = handles + ax_rss.get_legend_handles_labels()[0], labels + ax_rss.get_legend_handles_labels()[1]
    ax1.legend(handles, labels, fontsize=7)
    ax2.set_xticks(range(len(kinds)), kinds)
    ax2.set(ylabel=f"{unit} (worst rank)", title="optimizer state")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=110)

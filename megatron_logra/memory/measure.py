"""Measured host memory of a process: RSS, its peak, and exact live tensor bytes.

Used by the memory benchmarks and ``tools/memory_stress.py`` on CPU, where no allocator
statistics exist: :class:`LiveTensorTracker` counts every live tensor storage through a
``TorchDispatchMode`` (exact for tensors), RSS covers what tensors do not (kernel scratch,
allocator overhead). Linux ``/proc`` is read for RSS.
"""

from __future__ import annotations

__all__ = ["rss_bytes", "maxrss_bytes", "reset_peak_rss", "available_bytes", "LiveTensorTracker"]


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def maxrss_bytes() -> int:
    """Peak resident set size of this process (since start or the last :func:`reset_peak_rss`)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM, and with it ru_maxrss) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_bytes() -> "int | None":
    """Host memory this process can still take: ``MemAvailable`` of ``/proc/meminfo``, or less where the
    cgroup (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``) allows less above its current use; None when
    neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(used) as g:
                found.append(int(f.read()) - int(g.read()))  # "max" (no limit) is not an int
        except (OSError, ValueError):
            continue
    return max(0, min(found)) if found else None


class LiveTensorTracker:
    """Exact accounting of live tensor storages during a region, with its peak.

    Inside ``with tracker:`` a ``TorchDispatchMode`` sees every aten op (forward, backward
    on this thread, optimizer) and registers the storages of the tensors it returns. Each
    storage counts once (keyed by the storage object, which torch keeps unique per
    StorageImpl) with its current ``nbytes``; ``weakref.finalize`` on it subtracts it when
    torch frees it. On entry every tensor reachable by the garbage collector is registered
    too, so the figures are totals of live tensor bytes, not deltas.

    Not seen: scratch memory inside a kernel (e.g. oneDNN buffers, temporaries of a C++
    composite op that never reach the dispatcher) and allocator overhead. The RSS
    measurement covers those.
    """

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, str]] = {}
        self.by_origin: dict[str, int] = {}
        self.peak_breakdown: dict[str, int] = {}
        self.origin = "alive at start"
        self.current = 0
        self.peak = 0
        self.peak_phase = ""
        self.phase = "start"
        self.phase_peaks: dict[str, int] = {}
        self.start_bytes = 0
        self.active = False
        self._mode = None
        self.num_ops = 0
        self.sample_sum = 0.0
        """Sum of the live bytes after every op (``average`` = time-average over ops)."""

    # -- bookkeeping
    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            n, origin = entry
            self.current -= n
            self.by_origin[origin] -= n

    def _register(self, storage) -> None:
        import weakref

        try:
            n = storage.nbytes()
        except Exception:  # storages without data (meta, fake) — none expected here
            return
        key = id(storage)
        entry = self.live.get(key)
        if entry is None:
            if n == 0:
                return
            origin = self.origin
            self.live[key] = (n, origin)
            self.current += n
            self.by_origin[origin] = self.by_origin.get(origin, 0) + n
            weakref.finalize(storage, self._free, key)
        elif entry[0] != n:  # resized in place
            old, origin = entry
            self.live[key] = (n, origin)
            self.current += n - old
            self.by_origin[origin] += n - old
        else:
            return
        self._note_peak()

    def _note_peak(self) -> None:
        if not self.active:
            return
        phase = self.phase
        if phase == "fwd_bwd":
            import torch

            phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        if self.current > self.phase_peaks.get(phase, 0):
            self.phase_peaks[phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = phase
            self.peak_breakdown = {k: v for k, v in self.by_origin.items() if v > 0}

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    # -- context
    def __enter__(self) -> "LiveTensorTracker":
        import gc

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.num_ops += 1
                phase = tracker.phase
                if phase == "fwd_bwd":
                    phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ""
                tracker.origin = f"{phase} {func.__name__} {list(shape) if shape != '' else ''}".rstrip()
                stack = [out]
                while stack:
                    o = stack.pop()
                    if isinstance(o, torch.Tensor):
                        tracker._register(o.untyped_storage())
                    elif isinstance(o, (list, tuple)):
                        stack.extend(o)
                tracker.sample_sum += tracker.current
                return out

        gc.collect()
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                    self._register(obj.untyped_storage())
            except Exception:
                continue
        self.start_bytes = self.current
        self.peak = self.current
        self.peak_phase = "start"
        self.peak_breakdown = dict(self.by_origin)
        self.active = True
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.active = False

    @property
    def average(self) -> float:
        """Live bytes averaged over the ops run inside the region (the current value if none ran)."""
        return self.sample_sum / self.num_ops if self.num_ops else float(self.current)

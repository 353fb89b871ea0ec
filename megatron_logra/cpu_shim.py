"""CPU support for megatron-core: every CPU-only patch of megatron or torch lives here.

megatron-core assumes CUDA in a handful of places (``torch.cuda.current_device()`` as a
tensor device, stream/synchronize calls in pipeline p2p, the tensor-parallel RNG tracker
saving CUDA RNG states, literal ``device="cuda"`` in the schedules). ``activate()`` maps
them to the CPU so TP/PP/DP run on gloo process groups. It does nothing when a CUDA device
is present, and it is idempotent.

Patched:
  * megatron-core's ``jit_fuser`` (``megatron.core.jit``) -> a no-op decorator, set the moment that module
    is first imported (:func:`install_import_hook`, run when ``megatron_logra`` is imported, so before any
    of this package's megatron-core imports): megatron-core decorates ~40 functions with
    ``torch.compile`` as its modules import, which imports TorchDynamo and Inductor (about 2 s of every
    process start on a 2-core CPU) for fusions this project never calls (its ``TransformerConfig``
    turns every fusion off). On a CUDA machine the hook leaves the module as megatron-core made it.
  * ``torch.cuda.current_device`` -> ``"cpu"``; ``synchronize`` / ``empty_cache`` -> no-ops;
    ``current_stream`` / ``default_stream`` / ``Stream`` / ``stream`` -> a dummy stream.
  * ``torch.cuda.{get,set}_rng_state`` / ``manual_seed`` and megatron's
    ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> the CPU default generator, so the
    tracker's forked states (dropout under TP) are real CPU generator states.
  * torch factory functions, ``Tensor.cuda`` and ``Tensor.to`` rewrite ``device="cuda"`` to the
    CPU.

Patches of megatron-core that apply on GPUs as well live beside the code that needs them:
  * ``kl/forward_ad.py`` (``enable()``, on first use of the forward-AD KL probe): adds a ``jvp`` to
    megatron-core's tensor-parallel region mappings and frozen-weight linear ``autograd.Function``s.
  * ``checkpoint/dist_writer.py`` (``_metadata_write_failures``, during each sharded save only): swaps
    ``dist_checkpointing.strategies.torch.FileSystemWriterAsync`` for a subclass whose ``finish``
    collects a failed ``.metadata`` write, so every rank learns of it instead of blocking.
  * ``checkpoint/dist_writer.py`` (``_in_process_write_results``, at every sharded save): sets
    ``dist_checkpointing.strategies.filesystem_async._results_queue`` to an in-process ``queue.Queue``
    instead of the queue of the spawned Manager process megatron-core starts at the first save (every
    save here is synchronous).
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["activate", "install_import_hook", "is_active", "needed"]

# torch is imported inside the functions: ``install_import_hook`` runs when ``megatron_logra`` is imported,
# and commands that need no torch (``--help``, ``recipes``) must not pay for it.

_LOCK = threading.Lock()
_ACTIVE = False


def needed() -> bool:
    """True when no CUDA device is usable (the shim should be active)."""
    import torch

    return not torch.cuda.is_available()


def is_active() -> bool:
    return _ACTIVE


class _DummyStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _is_cuda(device) -> bool:
    import torch

    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


_FACTORIES = ("ones", "zeros", "empty", "full", "arange", "tensor", "as_tensor", "randn", "rand",
              "randint", "randperm", "eye", "linspace", "empty_strided", "ones_like", "zeros_like",
              "empty_like", "full_like")


def _redirect_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


def _tensor_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return orig(self, *args, **kwargs)

    return to


class _DropTrackerWarning(logging.Filter):
    # The tracker warns when the CPU RNG moved inside a fork; on CPU the forked state *is*
    # the CPU generator, so that is expected.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def activate() -> bool:
    """Install the CPU patches if no CUDA device is present. Returns True when active."""
    global _ACTIVE
    import torch

    if not needed():
        return False
    with _LOCK:
        if _ACTIVE:
            return True
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
        torch.cuda.current_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
        torch.cuda.default_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
        torch.cuda.Stream = _DummyStream  # type: ignore[assignment,misc]  (a class: annotations use it with |)
        torch.cuda.stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
        torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: keep that a no-op.
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
        torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
        try:
            from megatron.core.tensor_parallel import random as mrandom

            mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
            mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
            logging.getLogger(mrandom.__name__).addFilter(_DropTrackerWarning())
        except ImportError:  # megatron-core not installed: plain torch use
            pass
        # Literal device="cuda" / .cuda() / .to("cuda") in megatron-core (causal mask,
        # schedules): plain wrappers, which unlike a TorchFunctionMode also apply inside
        # autograd Functions (activation recompute).
        # TorchScript cannot compile through the wrappers: load the scripted forward-AD
        # decompositions (which call factories) before wrapping.
        importlib.import_module("torch._decomp.decompositions_for_jvp")
        # ``with torch.device(...)`` (meta init, transformers' from_pretrained) redirects the factories it
        # finds in a cache built on first use; built after wrapping, it would hold the wrappers and
        # silently skip the redirect (e.g. rotary inv_freq left uninitialised). Build it first.
        importlib.import_module("torch.utils._device")._device_constructors()

        for fname in _FACTORIES:
            setattr(torch, fname, _redirect_factory(getattr(torch, fname)))
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
        torch.Tensor.to = _tensor_to(torch.Tensor.to)  # type: ignore[assignment]
        _ACTIVE = True
        logger.info("no CUDA device: megatron-core CPU shim active")
    return True


_JIT_MODULE = "megatron.core.jit"


def _noop_decorator(fn):
    return fn


def _quiet_jit_fuser(module: ModuleType) -> None:
    """Right after ``megatron.core.jit`` ran (before any module imports its ``jit_fuser``): with no CUDA
    device, make ``jit_fuser`` a no-op decorator."""
    if not needed():
        return
    disable = getattr(module, "disable_jit_fuser", None)
    if callable(disable):
        disable()
    else:  # a megatron-core without the switch: set the name its modules import
        module.jit_fuser = _noop_decorator
    logger.debug("no CUDA device: megatron-core's jit_fuser is a no-op")


class _JitFuserFinder:
    """A ``sys.meta_path`` finder for ``megatron.core.jit`` only: it finds the module as the path finder
    would and runs :func:`_quiet_jit_fuser` after the module's own code."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname != _JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module  # a loader made for this spec alone

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _quiet_jit_fuser(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_import_hook() -> None:
    """Install the ``megatron.core.jit`` hook (idempotent; a no-op once that module is imported). Whether a
    CUDA device is present is asked only when megatron-core is imported, not here."""
    if _JIT_MODULE in sys.modules or any(isinstance(f, _JitFuserFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFuserFinder())

"""CUDA IPC payloads name their GPU by UUID, as SGLang's receiving side expects.

SGLang (``python/sglang/srt/utils/patch_torch.py``) patches torch's reductions so that the device
argument of ``rebuild_cuda_tensor`` (index 6) travels as the GPU's UUID; its schedulers rebuild with
``_rebuild_cuda_tensor_modified``, which maps a UUID to their own device index (older releases
assert a UUID). ``MultiprocessingSerializer.serialize`` (``python/sglang/srt/utils/common.py``) does
not patch anything itself, so a trainer that used it unpatched sent a device *index*, which names
another GPU (or none) in a server started with a different ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.multiprocessing import reductions

from megatron_logra.sync.sglang_payloads import (
    CUDA_DEVICE_ARG,
    _device_as_uuid,
    _uuid_pickler,
    serialize_named_tensors,
)


def _cuda_style_args(device):
    """The 15 arguments torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor`` (torch/multiprocessing/reductions.py)."""
    return (torch.Tensor, torch.Size([2]), (1,), 0, torch.UntypedStorage, torch.bfloat16, device, b"handle", 4, 0,
            False, b"ref", 0, b"event", True)


def test_the_device_index_of_a_cuda_reduction_becomes_its_uuid():
    uuids = {0: "GPU-aaaa", 3: "GPU-dddd"}
    fn, args = _device_as_uuid((reductions.rebuild_cuda_tensor, _cuda_style_args(3)), uuids.__getitem__)
    assert fn is reductions.rebuild_cuda_tensor
    assert args[CUDA_DEVICE_ARG] == "GPU-dddd"
    assert args[:CUDA_DEVICE_ARG] + args[CUDA_DEVICE_ARG + 1:] == \
        _cuda_style_args(3)[:CUDA_DEVICE_ARG] + _cuda_style_args(3)[CUDA_DEVICE_ARG + 1:]
    already = (reductions.rebuild_cuda_tensor, _cuda_style_args("GPU-aaaa"))
    assert _device_as_uuid(already, uuids.__getitem__) is already  # a sender SGLang already patched


def test_cpu_reductions_are_left_alone_and_round_trip():
    t = torch.arange(6, dtype=torch.int64)
    cpu = reductions.reduce_tensor(t)  # a real reduction of a CPU tensor: no device slot to rewrite
    assert _device_as_uuid(cpu, lambda d: pytest.fail("no CUDA device to name")) is cpu
    buf = io.BytesIO()
    _uuid_pickler(buf).dump([("w", t)])
    (name, back), = pickle.loads(buf.getvalue())
    assert name == "w" and torch.equal(back, t)


def test_cuda_ipc_refuses_cpu_tensors():
    from megatron_logra.sync.errors import SyncError

    with pytest.raises(SyncError, match="needs CUDA tensors"):
        serialize_named_tensors([("w", torch.zeros(2))], "cuda_ipc")


class _Recorder(pickle.Unpickler):
    """Unpickles everything but records the arguments ``rebuild_cuda_tensor`` would get (no IPC handle is opened)."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.calls = []

    def find_class(self, module, name):
        if name in ("rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified"):
            return lambda *args: self.calls.append(args) or torch.empty(0)
        return super().find_class(module, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_ipc_entry_names_the_gpu_by_uuid():  # pragma: no cover - GPU only
    import base64

    t = torch.arange(4, dtype=torch.float32, device="cuda")
    entry = serialize_named_tensors([("w", t)], "cuda_ipc")
    rec = _Recorder(base64.b64decode(entry))
    rec.load()
    (args,) = rec.calls
    assert args[CUDA_DEVICE_ARG] == str(torch.cuda.get_device_properties(t.device.index).uuid)

"""Contracts with SGLang's source that the SGLang clients rely on, each pinned where SGLang states it.

* ``mem_fraction_static`` is a fraction of the memory free when the engine starts: ``ModelRunner`` keeps the
  free memory measured before it loads weights (``min_per_gpu_memory``; ``pre_model_load_memory`` in newer
  releases) and sizes its KV cache as ``free_after_weights - pre_load_free * (1 - mem_fraction_static)``.
* Newer ``http_server.py`` marks the control routes the client uses (``/pause_generation``,
  ``/continue_generation``, ``/flush_cache``) ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` like the weight routes:
  with ``--api-key`` and ``--admin-api-key`` both set they take only the admin key (``utils/auth.py``:
  ``decide_request_auth``); older releases leave them normal. The client sends the admin key first there.
* ``MultiprocessingSerializer.deserialize`` unpickles HTTP payloads with ``SafeUnpickler``, whose allow-list
  holds module prefixes (``builtins.``, ``collections.``, ``copyreg.``, ``torch.`` ...); a payload pickled by
  value must name nothing else.
"""

from __future__ import annotations

import base64
import pickle
import pickletools

import pytest
import torch

from megatron_logra.rollout.sglang_api import sglang_mem_fraction
from megatron_logra.sync.sglang_client import SGLangServerTarget, serialize_named_tensors
from megatron_logra.sync.sglang_wire import command_as_named_tensors, delta_as_named_tensors
from support.sglang_stand_ins import (ADMIN_OPTIONAL_CONTROL_ROUTES, ADMIN_OPTIONAL_ROUTES, FakeServer,
                                      SchedulerRuntime, SGLangLlama, delta_chain, hf_state,
                                      servers)  # noqa: F401  (servers: a fixture)

GIB = 1 << 30


def _sglang_engine_bytes(fraction: float, free_at_start: float) -> float:
    """Weights + KV cache SGLang holds for ``mem_fraction_static=fraction`` (ModelRunner's KV sizing)."""
    return free_at_start * fraction


@pytest.mark.parametrize("free_gib", [80, 60, 45, 30])
def test_engine_takes_its_share_of_the_whole_gpu_whatever_the_trainer_holds(free_gib):
    total, share = 80 * GIB, 0.3
    fraction = sglang_mem_fraction(share, free_bytes=free_gib * GIB, total_bytes=total)
    assert _sglang_engine_bytes(fraction, free_gib * GIB) == pytest.approx(share * total)
    left_to_trainer = free_gib * GIB - _sglang_engine_bytes(fraction, free_gib * GIB)
    assert left_to_trainer == pytest.approx((free_gib / 80 - share) * total)


def test_engine_fraction_is_capped_and_refused_when_the_share_is_not_free():
    assert sglang_mem_fraction(0.3, free_bytes=25 * GIB, total_bytes=80 * GIB) == pytest.approx(0.95)  # 24/25 > cap
    with pytest.raises(ValueError, match="only 0.20 of the GPU is free"):
        sglang_mem_fraction(0.3, free_bytes=16 * GIB, total_bytes=80 * GIB)


def test_control_routes_take_the_admin_key_on_servers_that_mark_them_admin_level(servers):
    runtime = SchedulerRuntime([SGLangLlama(hf_state())])
    server = FakeServer(runtime, api_key="user", admin_api_key="admin",
                        admin_routes=ADMIN_OPTIONAL_ROUTES | ADMIN_OPTIONAL_CONTROL_ROUTES)
    servers.append(server)
    target = SGLangServerTarget(server.url, api_key="user", admin_api_key="admin", timeout=10)
    deltas = delta_chain(2)
    for d in deltas:
        assert target.apply_sketch_delta(d) == d.new_version
    admin = ADMIN_OPTIONAL_ROUTES | ADMIN_OPTIONAL_CONTROL_ROUTES
    sent = [(r["path"], r["headers"].get("authorization")) for r in server.requests]
    assert any(p == "/pause_generation" for p, _ in sent) and any(p == "/continue_generation" for p, _ in sent)
    for path, header in sent:  # every request authorised at the first try: no refused one, no retry
        assert header == ("Bearer admin" if path in admin else "Bearer user"), (path, header)


class _SGLangSafeUnpickler(pickle.Unpickler):
    """SGLang ``utils/common.py`` ``SafeUnpickler``: module-prefix allow-list plus its deny-list."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
               "weakref.", "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.",
               "pickletools.", "sglang.srt.weight_sync.tensor_bucket.", "sglang.srt.model_executor.model_runner.",
               "sglang.srt.layers.", "sglang.srt.utils.")
    DENY = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("types", "CodeType"),
            ("types", "FunctionType")}

    def find_class(self, module, name):
        if (module, name) in self.DENY or not any((module + ".").startswith(p) for p in self.ALLOWED):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


def _globals(data: bytes) -> set[str]:
    """The ``module name`` pairs a pickle names (GLOBAL / STACK_GLOBAL)."""
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            out.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            out.add(f"{strings[-2]}.{strings[-1]}")
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_pickled_payloads_pass_sglangs_safe_unpickler(dtype):
    dense = [("model.layers.0.mlp.down_proj.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)),
             ("model.norm.weight", torch.ones(4, dtype=dtype)[1:])]  # a view: shipped compact
    delta = delta_as_named_tensors(b"\x00\x01\x02") + command_as_named_tensors({"op": "apply", "nonce": "n"})
    for named in (dense, delta):
        data = base64.b64decode(serialize_named_tensors(named, "pickle"), validate=True)
        names = _globals(data)
        assert all(any((g + ".").startswith(p) for p in _SGLangSafeUnpickler.ALLOWED) for g in names), names
        back = _SGLangSafeUnpickler(__import__("io").BytesIO(data)).load()
        assert [n for n, _ in back] == [n for n, _ in named]
        assert all(torch.equal(b, t) and b.dtype == t.dtype for (_, b), (_, t) in zip(back, named))

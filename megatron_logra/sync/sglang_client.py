"""Trainer-side clients that push sketch deltas to SGLang (in-process ``sglang.Engine`` or an HTTP server).

Both targets speak the engine protocol :class:`megatron_logra.rl.policy_sync.PolicySync` uses::

    target.weight_version                    # int: the version the engine's weights are at
    target.apply_sketch_delta(payload)       # encoded delta (or SketchDelta) -> new version
    target.update_weights_full(hf_state, v)  # dense refit under HF names, then version := v
    target.fingerprint()                     # {HF name: sha256@version} of the engine weights, or None

This module holds the two transports, :class:`SGLangEngineTarget` and :class:`SGLangServerTarget`:
each supplies the primitives (server info, ``update_weights_from_tensor``, ``get_weights_by_name``,
pause/continue, version tag) that :mod:`~megatron_logra.sync.sglang_protocol` turns into the
protocol (how a delta travels and how its outcome is verified, the full refit, fingerprints, and
the engines that take dense refits only: pipeline stages, ``--pp-size > 1``, and data-parallel
attention, ``--dp-size > 1``, whose read-backs hold one answer per data-parallel rank).
A fingerprint's rows are sampled with the engine's weight version as the salt (its digests end in
``@<version>``): compare it with ``fingerprint(hf, salt=fingerprint_salt(fp))``
(:mod:`~megatron_logra.sync.fingerprint`), as policy sync does.
Request payloads and :class:`SGLangError` live in :mod:`~megatron_logra.sync.sglang_payloads`, the HTTP
transport in :mod:`~megatron_logra.sync.sglang_http`; every public name this module had is still importable
from here.

Generation is paused around updates when the engine can pause (HTTP ``/pause_generation`` and
``/continue_generation``; SGLang's default pause mode aborts in-flight requests, and the
cache flush after a weight update asserts that nothing is running). Without a pause, SGLang
still serialises the update behind in-flight requests (its model-update writer lock).

Imports only torch, safetensors (via the codec) and the standard library (never SGLang).
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_logra.sync.sglang_http import ADMIN_ROUTES, SERVER_INFO_PATHS, SGLangServerTarget, rank_entries
from megatron_logra.sync.sglang_payloads import (
    DEFAULT_CHUNK_BYTES,  # noqa: F401  (re-exported)
    SERIALIZATIONS,
    SGLangError,
    chunk_named_tensors,
    serialize_named_tensors,
)
from megatron_logra.sync.sglang_primitives import _READ_ALL
from megatron_logra.sync.sglang_protocol import _SGLangTarget
from megatron_logra.sync.sglang_wire import LOADER_PATH

logger = logging.getLogger(__name__)

__all__ = [
    "SGLangError", "SGLangEngineTarget", "SGLangServerTarget", "serialize_named_tensors", "chunk_named_tensors",
    "LOADER_PATH", "SERIALIZATIONS", "ADMIN_ROUTES", "SERVER_INFO_PATHS", "rank_entries",
]


def _result(res: Any) -> tuple[bool, str]:
    """``(success, message)`` from whatever SGLang's Engine returned (tuple, dict or output object)."""
    if isinstance(res, tuple) and len(res) >= 2:
        return bool(res[0]), str(res[1])
    if isinstance(res, dict):
        return bool(res.get("success")), str(res.get("message", ""))
    if hasattr(res, "success"):
        return bool(res.success), str(getattr(res, "message", ""))
    return bool(res), ""


# --------------------------------------------------------------------------- in-process engine


class SGLangEngineTarget(_SGLangTarget):
    """An in-process ``sglang.Engine`` (its scheduler runs in a child process; tensors go by shared memory).

    Start the engine with ``custom_weight_loader=[LOADER_PATH]``; sketch deltas need ``pp_size == 1`` and
    ``dp_size == 1`` (with ``dp_size > 1`` and ``enable_dp_attention=True`` it takes dense refits only,
    without it no tensor update at all). ``pause`` uses the engine's
    ``pause_generation``/``continue_generation`` when it has them (the offline Engine usually
    does not; a synchronous caller has nothing in flight anyway).
    """

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine

    def _server_info(self) -> dict:
        args = getattr(self.engine, "server_args", None)
        if args is None:
            return {}
        info = {"custom_weight_loader": getattr(args, "custom_weight_loader", None),
                "tp_size": getattr(args, "tp_size", 1), "dp_size": getattr(args, "dp_size", 1),
                "pp_size": getattr(args, "pp_size", 1)}
        if hasattr(args, "enable_dp_attention"):
            info["enable_dp_attention"] = args.enable_dp_attention
        return info

    def _update(self, named_tensors, load_format, flush_cache):
        named = [(n, t.detach()) for n, t in named_tensors]
        return _result(self.engine.update_weights_from_tensor(named, load_format=load_format, flush_cache=flush_cache))

    def _read_param(self, name):
        values = self.engine.get_weights_by_name(name, truncate_size=_READ_ALL)  # one list per DP rank at dp > 1
        return values if isinstance(values, list) else None

    def _pause(self):
        fn = getattr(self.engine, "pause_generation", None)
        if callable(fn):
            fn()

    def _continue(self):
        fn = getattr(self.engine, "continue_generation", None)
        if callable(fn):
            fn()

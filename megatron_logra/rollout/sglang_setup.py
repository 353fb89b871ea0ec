"""Start-up rules of the SGLang engine that need neither SGLang nor a GPU: where an in-process engine
may run (:func:`check_engine_gpus`) and how the server's API key is kept off disk
(:func:`redact_config`, :func:`resolve_api_key`).

The API key (``rl.rollout.sglang_api_key``) is a credential: a config written to disk (``RUN/config.yaml``,
every checkpoint's config) holds :data:`REDACTED_API_KEY` in its place, and a config read back (``train
--resume RUN``) turns that placeholder into an empty key, which :func:`resolve_api_key` fills from the
environment variable :data:`API_KEY_ENV` (``SGLANG_API_KEY``). The admin key of newer SGLang servers
(``rl.rollout.sglang_admin_api_key``, else ``SGLANG_ADMIN_API_KEY``) is kept off disk the same way. Either
source loses its surrounding whitespace (a key read from a secret file ends in a newline); a key that still
cannot travel in an HTTP header is refused naming its source, never quoting it (:func:`check_api_key`).
Imports no SGLang and no torch.
"""

from __future__ import annotations

import copy
import os
import unicodedata
from typing import Any, Mapping, Optional, Sequence

__all__ = ["ADMIN_API_KEY_ENV", "ADMIN_KEY_FIELD", "API_KEY_ENV", "CONFIG_KEY_FIELD", "REDACTED_API_KEY",
           "check_api_key", "check_engine_gpus", "contiguous_run", "redact_config", "resolve_api_key"]

CONFIG_KEY_FIELD = "rl.rollout.sglang_api_key"
"""The config field holding the server's API key."""
API_KEY_ENV = "SGLANG_API_KEY"
"""Environment variable holding the server's API key when ``rl.rollout.sglang_api_key`` is empty."""
ADMIN_KEY_FIELD = "rl.rollout.sglang_admin_api_key"
"""The config field holding the server's admin API key (``--admin-api-key``)."""
ADMIN_API_KEY_ENV = "SGLANG_ADMIN_API_KEY"
"""Environment variable holding the admin key when ``rl.rollout.sglang_admin_api_key`` is empty."""
_KEY_FIELDS = ("sglang_api_key", "sglang_admin_api_key")
REDACTED_API_KEY = "***"
"""What saved configs hold instead of a non-empty ``rl.rollout.sglang_api_key``; read back, it means "no key
in the config" (``RolloutConfig`` turns it into ``""``), never a key to send."""


def redact_config(data: Mapping[str, Any]) -> dict:
    """A deep copy of ``data`` (a run config as :func:`megatron_logra.config.to_dict` gives it) that is safe to
    write to disk: a non-empty ``rl.rollout.sglang_api_key`` or ``rl.rollout.sglang_admin_api_key`` becomes
    :data:`REDACTED_API_KEY`; everything else, and ``data`` itself, is unchanged."""
    out = copy.deepcopy(dict(data))
    rollout = out.get("rl", {}).get("rollout") if isinstance(out.get("rl"), dict) else None
    for field in _KEY_FIELDS:
        if isinstance(rollout, dict) and rollout.get(field):
            rollout[field] = REDACTED_API_KEY
    return out


def resolve_api_key(config_key: str, env: Optional[Mapping[str, str]] = None, *, field: str = CONFIG_KEY_FIELD,
                    env_var: str = API_KEY_ENV) -> Optional[str]:
    """The bearer token to send to the SGLang server: ``config_key`` (the config ``field``,
    ``rl.rollout.sglang_api_key`` by default) when it is set, else ``env[env_var]`` (``SGLANG_API_KEY``;
    ``os.environ`` by default) when that is set, else None (no ``Authorization`` header). The admin key:
    ``field=ADMIN_KEY_FIELD, env_var=ADMIN_API_KEY_ENV``. :data:`REDACTED_API_KEY` is never returned as a
    key: it counts as unset.

    Surrounding whitespace is stripped (a key read from a secret file usually ends in a newline), and a key
    that still holds whitespace, control characters or characters outside Latin-1 (which no HTTP header can
    carry) is refused with a ``ValueError`` that names where the key came from, never the key itself.
    """
    env = os.environ if env is None else env
    for source, raw in ((field, config_key), (env_var, env.get(env_var, ""))):
        key = raw.strip() if isinstance(raw, str) else raw
        if key and key != REDACTED_API_KEY:
            check_api_key(key, source)
            return key
    return None


def check_api_key(key: str, source: str) -> None:
    """Refuse an API key (from ``source``: a config field or environment variable) that cannot travel in an
    ``Authorization`` header: one holding whitespace or control characters, or characters outside Latin-1.
    The ``ValueError`` names ``source`` and the kind of character, never the key or a part of it."""
    bad = next((c for c in key if c.isspace() or unicodedata.category(c) == "Cc" or ord(c) > 0xFF), None)
    if bad is None:
        return
    what = "a character outside Latin-1" if ord(bad) > 0xFF else \
        "whitespace or a control character (e.g. a line break)"
    raise ValueError(f"the SGLang API key from {source} contains {what} inside it, which an HTTP Authorization "
                     f"header cannot carry (surrounding whitespace is already stripped): set {source} to the "
                     "server's --api-key exactly")


def contiguous_run(ranks: Sequence[int], start: int) -> int:
    """How many of ``start, start + 1, ...`` are in ``ranks`` (global ranks of one model replica) before the
    first gap: the GPUs from ``start``'s device up that belong to that replica (torchrun gives the ranks of a
    node consecutive ``LOCAL_RANK``\\ s, and each rank uses device ``LOCAL_RANK``). 0 when ``start`` is not in
    ``ranks``."""
    members = set(int(r) for r in ranks)
    n = 0
    while start + n in members:
        n += 1
    return n


def check_engine_gpus(sglang_tp: int, *, base_gpu_id: int, device_count: int, replica_gpus: int) -> None:
    """Refuse an in-process engine of ``sglang_tp`` GPUs starting at device ``base_gpu_id`` that does not fit
    this DP replica's GPUs (``ValueError`` naming ``rl.rollout.sglang_tp`` and the fix).

    SGLang runs its TP ranks on devices ``[base_gpu_id, base_gpu_id + sglang_tp)``. They must exist
    (``base_gpu_id + sglang_tp <= device_count``) and be this replica's own (``sglang_tp <= replica_gpus``,
    the devices from ``base_gpu_id`` up that the replica's ranks use, :func:`contiguous_run`): otherwise two
    replicas' engines would reserve ``mem_fraction_static`` on the same GPUs, or SGLang would fail on a
    device that does not exist. A pure function of the counts.
    """
    if sglang_tp < 1 or base_gpu_id < 0:
        raise ValueError(f"rl.rollout.sglang_tp={sglang_tp} must be >= 1 and base_gpu_id={base_gpu_id} >= 0")
    last = base_gpu_id + sglang_tp
    if last > device_count:
        raise ValueError(
            f"rl.rollout.sglang_tp={sglang_tp}: this replica's engine would run on GPUs {base_gpu_id}..{last - 1}, "
            f"but this node has {device_count} visible GPUs; set rl.rollout.sglang_tp to at most "
            f"{max(min(replica_gpus, device_count - base_gpu_id), 1)} (0 = parallel.tp)")
    if sglang_tp > replica_gpus:
        raise ValueError(
            f"rl.rollout.sglang_tp={sglang_tp}: this DP replica's ranks use {replica_gpus} GPU(s) from GPU "
            f"{base_gpu_id} up, so its engine would also take GPUs {base_gpu_id + replica_gpus}..{last - 1} of "
            f"another replica (two engines reserving memory on one GPU); set rl.rollout.sglang_tp to at most "
            f"{max(replica_gpus, 1)} (0 = parallel.tp), or launch fewer DP replicas per node")

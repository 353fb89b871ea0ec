"""The HTTP transport of the SGLang engine protocol: :class:`SGLangServerTarget`, a running SGLang server.

Owns everything that is HTTP: the JSON requests and their failures (:class:`SGLangError` ``unreachable``,
``http``, ``config``, ``auth``), which key each route takes (``--api-key``, or ``--admin-api-key`` on
:data:`ADMIN_ROUTES`, retried once with the other key on 401 or 403), where the server's arguments are served
(:data:`SERVER_INFO_PATHS`), one serialization of an update per scheduler (:func:`rank_entries`), and the
routes a server may lack (pause, version tag). How an update travels (``serialization``: ``pickle`` by value,
``cuda_ipc`` by handle) is described in :mod:`~megatron_logra.sync.sglang_payloads`. The protocol on top of the primitives is
:mod:`~megatron_logra.sync.sglang_protocol`'s; the in-process engine is in
:mod:`~megatron_logra.sync.sglang_client`, from which these names stay importable.

Imports only torch, safetensors (via the codec) and the standard library (never SGLang, never ``requests``).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import unicodedata
import urllib.error
import urllib.request
from typing import Any, Callable, Optional, Sequence

from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.sglang_payloads import SERIALIZATIONS, SGLangError, serialize_named_tensors
from megatron_logra.sync.sglang_primitives import _READ_ALL
from megatron_logra.sync.sglang_protocol import _SGLangTarget

logger = logging.getLogger(__name__)


ADMIN_ROUTES = frozenset({"/update_weights_from_tensor", "/update_weight_version", "/get_weights_by_name",
                          "/pause_generation", "/continue_generation", "/flush_cache"})
"""Routes that take the server's ``--admin-api-key`` first when one is given: SGLang marks its weight routes
(``update_weights_from_tensor``, ``update_weight_version``, ``get_weights_by_name``) admin-level, which with
both keys configured accept only the admin key; every other route takes ``--api-key`` only. Which control
routes are admin-level differs between versions, so a 401 or 403 is retried once with the other key."""
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
"""Where SGLang serves its server arguments: ``/server_info`` in newer versions (which deprecate the older
``/get_server_info``), only ``/get_server_info`` in older ones; the first that answers is kept."""


def rank_entries(named_tensors: list, serialization: str, num_ranks: int,
                 serialize: Callable[[list, str], str] = serialize_named_tensors) -> list[str]:
    """``serialized_named_tensors`` of an HTTP update: one entry per scheduler (TP rank) of the server.

    By value (``pickle``) the ranks share one serialization. Over CUDA IPC each rank gets its own, as
    ``sglang.Engine`` serialises per rank: every process that opens a handle releases one reference to the
    producer's block when it is done, so one handle opened by ``num_ranks`` schedulers would be released
    ``num_ranks`` times for the one reference taken.
    """
    if serialization == "cuda_ipc":
        return [serialize(named_tensors, serialization) for _ in range(num_ranks)]
    return [serialize(named_tensors, serialization)] * num_ranks


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    text = body if isinstance(body, str) else json.dumps(body)
    return text[:500]


class SGLangServerTarget(_SGLangTarget):
    """A running SGLang HTTP server (``python -m sglang.launch_server ... --custom-weight-loader LOADER_PATH``;
    sketch deltas need ``--pp-size 1`` and ``--dp-size 1``: with ``--dp-size N > 1 --enable-dp-attention``
    it takes dense refits only, and without ``--enable-dp-attention`` SGLang refuses every tensor update).

    ``api_key`` is sent as ``Authorization: Bearer <key>`` (SGLang's ``--api-key``); ``admin_api_key``
    (the server's ``--admin-api-key``, newer SGLang) instead on :data:`ADMIN_ROUTES`. Where a route refuses
    the key tried first (401 or 403) and the other key is set, the request is sent once more with the other,
    and the key that worked is kept for that route. ``timeout`` bounds every request (weight updates
    included). ``serialization``: see the module docstring. Environment proxies are ignored unless ``proxies`` is given.
    """

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 300.0, *,
                 serialization: str = "pickle", proxies: Optional[dict] = None,
                 admin_api_key: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if serialization not in SERIALIZATIONS:
            raise SyncError("config", f"unknown serialization {serialization!r}; choose one of {SERIALIZATIONS}")
        self.base_url = base_url.rstrip("/")
        for field, key in (("api_key", api_key), ("admin_api_key", admin_api_key)):
            if key and any(c.isspace() or unicodedata.category(c) == "Cc" or ord(c) > 0xFF for c in key):
                raise SGLangError("config", f"{field} contains whitespace, a control character or a character "
                                            "outside Latin-1, which an HTTP Authorization header cannot carry; pass "
                                            "the server's key exactly (rollout.sglang_setup.resolve_api_key strips "
                                            "a trailing newline)")
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self._route_admin: dict[str, bool] = {}  # path -> whether the admin key is the one that works there
        self._info_path: Optional[str] = None
        self.timeout = timeout
        self.serialization = serialization
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies or {}))
        self._tp_size: Optional[int] = None
        self._no_pause = False
        self._no_version_endpoint = False

    def request(self, method: str, path: str, body: Any = None, *, ok_status: Sequence[int] = ()) -> tuple[int, Any]:
        """One JSON request; returns ``(status, decoded body)``. Raises :class:`SGLangError` on a
        network failure (``unreachable``), a malformed answer (``http``), a request that cannot be sent
        (``config``: an invalid URL or header value; the message never quotes the headers, so the API
        key stays out of logs), 401 or 403 with every configured key (``auth``), or any status >= 400 not
        in ``ok_status`` (``http``)."""
        admin = self._route_admin.get(path, bool(self.admin_api_key) and path in ADMIN_ROUTES)
        status, decoded = self._http(method, path, body, self.admin_api_key if admin else self.api_key)
        other = self.api_key if admin else self.admin_api_key
        if status in (401, 403) and other:
            retry_status, retry_decoded = self._http(method, path, body, other)
            if retry_status not in (401, 403):
                self._route_admin[path] = not admin
                logger.info("SGLang %s takes the %s key", path, "API" if admin else "admin")
                status, decoded = retry_status, retry_decoded
        url = f"{self.base_url}{path}"
        if status in (401, 403):
            admin_hint = self.admin_api_key or status == 403 or path in ADMIN_ROUTES
            hint = ("check api_key and admin_api_key (the server's --api-key and --admin-api-key; with both set, "
                    "SGLang's weight routes take only the admin key: rl.rollout.sglang_admin_api_key or "
                    "SGLANG_ADMIN_API_KEY)") if admin_hint else "check api_key"
            raise SGLangError("auth", f"{method} {url}: {status} {'unauthorized' if status == 401 else 'forbidden'} "
                                      f"({_error_text(decoded)}); {hint}", status=status, body=decoded)
        if status >= 400 and status not in ok_status:
            raise SGLangError("http", f"{method} {url}: HTTP {status}: {_error_text(decoded)}", status=status,
                              body=decoded)
        return status, decoded

    def _http(self, method: str, path: str, body: Any, key: Optional[str]) -> tuple[int, Any]:
        """One request with ``key`` as the bearer token (None: no ``Authorization`` header)."""
        url = f"{self.base_url}{path}"
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SGLangError("unreachable", f"{method} {url}: SGLang server unreachable ({reason})") from None
        except (ValueError, http.client.InvalidURL) as exc:  # the text may quote a header, Authorization included
            raise SGLangError("config", f"{method} {url}: the request could not be sent ({type(exc).__name__}: "
                                        "an invalid URL or header value; check the server URL and that the API "
                                        "key holds no whitespace or control characters)") from None
        except http.client.HTTPException as exc:  # a malformed or cut-off answer (the text is the server's)
            raise SGLangError("http", f"{method} {url}: bad answer from the SGLang server "
                                      f"({type(exc).__name__}: {exc})") from None
        try:
            decoded: Any = json.loads(raw) if raw else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            decoded = raw.decode("utf-8", "replace")
        return status, decoded

    def server_info(self) -> dict:
        """The server's arguments and state (:data:`SERVER_INFO_PATHS`: ``/server_info``, else the older
        ``/get_server_info``); :class:`SGLangError` when neither answers a JSON object."""
        kept = [self._info_path] if self._info_path else []
        for path in kept + [p for p in SERVER_INFO_PATHS if p not in kept]:  # a restarted server may have the other
            status, info = self.request("GET", path, ok_status=(404, 405))
            if status in (404, 405):
                continue
            if not isinstance(info, dict):
                raise SGLangError("http", f"{path} returned {type(info).__name__}, expected a JSON object")
            self._info_path = path
            return info
        raise SGLangError("http", f"{self.base_url} answers neither of {SERVER_INFO_PATHS} (404): is it an SGLang "
                                  "server?")

    def _server_info(self) -> dict:
        info = self.server_info()
        self._tp_size = int(info.get("tp_size") or 1)
        return info

    def _update(self, named_tensors, load_format, flush_cache):
        if self._tp_size is None:
            self._server_info()
        if self.serialization == "cuda_ipc":  # IPC handles of CUDA copies, alive until the server has loaded them
            named_tensors = [(n, t if t.is_cuda else t.to("cuda", non_blocking=False)) for n, t in named_tensors]
        entries = rank_entries(named_tensors, self.serialization, int(self._tp_size or 1))
        body = {"serialized_named_tensors": entries, "load_format": load_format, "flush_cache": flush_cache}
        status, resp = self.request("POST", "/update_weights_from_tensor", body, ok_status=(400,))
        if not isinstance(resp, dict):
            return False, f"HTTP {status}: {_error_text(resp)}"
        return bool(resp.get("success")) and status == 200, str(resp.get("message", ""))

    def _read_param(self, name):
        # 400 when the (single) rank could not read it; at dp_size > 1 a list with null for such DP ranks
        status, resp = self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": _READ_ALL},
                                    ok_status=(400,))
        return resp if status == 200 and isinstance(resp, list) else None

    def _control(self, path: str) -> None:
        if self._no_pause:
            return
        status, _ = self.request("POST", path, {}, ok_status=(404, 405))
        if status in (404, 405):
            self._no_pause = True
            logger.warning("SGLang server has no %s; updating without pausing generation", path)

    def _pause(self):
        self._control("/pause_generation")

    def _continue(self):
        self._control("/continue_generation")

    def _publish_version(self, version: int) -> None:
        if self._no_version_endpoint:
            return
        status, _ = self.request("POST", "/update_weight_version",
                                 {"new_version": str(version), "abort_all_requests": False}, ok_status=(404, 405))
        if status in (404, 405):
            self._no_version_endpoint = True
            logger.info("SGLang server has no /update_weight_version; its weight_version tag is not updated")

    def flush_cache(self) -> bool:
        """POST ``/flush_cache`` (SGLang refuses, with 400, while requests are running)."""
        status, _ = self.request("POST", "/flush_cache", ok_status=(400,))
        return status == 200

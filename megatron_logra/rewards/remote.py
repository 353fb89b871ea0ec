"""A reward server over HTTP (``task.reward=http://HOST:PORT/PATH``), as slime's ``--rm-url``: a reward model, a
code sandbox or any scorer that runs as a service.

Contract: each completion is one ``POST`` of a JSON object ``{"prompt", "response", "label", "source", "id",
"metadata"}`` (the problem's text, the completion, the gold answer, the source name, the problem's id and its
metadata; values JSON cannot hold are sent as text) with ``Content-Type: application/json`` and, when
``MEGATRON_LOGRA_REWARD_API_KEY`` is set, ``Authorization: Bearer <key>``. The server answers with a JSON number
in ``[0, 1]`` or an object holding one under ``"reward"`` or ``"score"`` (1 = correct;
:class:`~megatron_logra.rewards.task.Task` maps it to the configured rewards).

A connection that fails or an HTTP 5xx answer is retried (:data:`RETRIES` more times, after 0.5 s, then 1 s, ...);
one call with its retries takes at most ``task.reward_timeout_s`` (0: each request waits as long as the server
takes), past which :class:`~megatron_logra.rewards.deadline.RewardTimeout` stops the run as a hung plugin does.
Any other failure (4xx, an answer that is not such a number, a server that stays down) is a ``ValueError``
naming the URL and what came back: a reward that cannot be computed is not a wrong answer.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from typing import Any, Optional

from megatron_logra.rewards.base import Problem
from megatron_logra.rewards.deadline import RewardTimeout

__all__ = ["API_KEY_ENV", "RETRIES", "RemoteScorer", "is_reward_url"]

API_KEY_ENV = "MEGATRON_LOGRA_REWARD_API_KEY"
"""Environment variable whose value, when set, is sent as ``Authorization: Bearer <value>``."""

RETRIES = 3
"""Further attempts after a failed connection or an HTTP 5xx answer."""

_SHOWN = 200
"""Characters of a server's answer an error message quotes."""


def is_reward_url(value: str) -> bool:
    """Whether ``task.reward`` names a reward server (``http://`` or ``https://``)."""
    return isinstance(value, str) and value.startswith(("http://", "https://")) and len(value.split("://", 1)[1]) > 0


def _value_of(answer: Any) -> Any:
    if isinstance(answer, dict):
        for key in ("reward", "score"):
            if key in answer:
                return answer[key]
    return answer


class RemoteScorer:
    """A :class:`~megatron_logra.rewards.base.Scorer` that asks the reward server at ``url`` (see the module doc).
    ``timeout_s``: ``task.reward_timeout_s`` (0 or None: no limit)."""

    def __init__(self, url: str, timeout_s: Optional[float] = None) -> None:
        if not is_reward_url(url):
            raise ValueError(f"task.reward={url!r}: a reward server is an http:// or https:// URL")
        self.url = url
        self.timeout_s = float(timeout_s) if timeout_s else None

    def score(self, problem: Problem, completion: str) -> float:
        """The server's score of ``completion`` for ``problem``, a float in ``[0, 1]``."""
        body = json.dumps({"prompt": problem.prompt, "response": completion, "label": problem.answer,
                           "source": problem.source, "id": problem.metadata.get("id"),
                           "metadata": problem.metadata}, default=str).encode()
        text = self._post(body)
        try:
            value = _value_of(json.loads(text))
        except json.JSONDecodeError:
            raise ValueError(f"reward server {self.url} answered {text[:_SHOWN]!r}, not JSON; expected a number in "
                             f"[0, 1] or {{\"reward\": number}}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0.0 <= value <= 1.0:
            raise ValueError(f"reward server {self.url} answered {text[:_SHOWN]!r}; expected a number in [0, 1] "
                             f"or {{\"reward\": number}}")
        return float(value)

    def _post(self, body: bytes) -> str:
        """The server's answer to ``body``, retrying failed connections and 5xx answers within the deadline."""
        headers = {"Content-Type": "application/json"}
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        last = ""
        for attempt in range(RETRIES + 1):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=left) as response:
                    return response.read().decode("utf-8", errors="replace")
            except urllib.error.HTTPError as exc:
                answer = exc.read().decode("utf-8", errors="replace")[:_SHOWN]
                if exc.code < 500:
                    raise ValueError(f"reward server {self.url} answered HTTP {exc.code} ({exc.reason}): "
                                     f"{answer!r}") from None
                last = f"HTTP {exc.code} ({exc.reason}): {answer!r}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                    last = "no answer in time"
                    break
                last = f"{type(reason).__name__}: {reason}"
            if attempt < RETRIES:
                pause = 0.5 * 2 ** attempt
                if deadline is not None:
                    pause = min(pause, max(0.0, deadline - time.monotonic()))
                time.sleep(pause)
        if deadline is not None and time.monotonic() >= deadline:
            raise RewardTimeout(f"reward server {self.url} did not answer within {self.timeout_s:g} s "
                                f"(task.reward_timeout_s={self.timeout_s:g}; last: {last or 'no answer in time'}); "
                                f"check the server, or raise task.reward_timeout_s if it is merely slow")
        raise ValueError(f"reward server {self.url} failed {RETRIES + 1} times (last: {last}); is it running and "
                         f"reachable from this node?")

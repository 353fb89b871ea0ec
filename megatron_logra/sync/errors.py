"""The one exception type of policy sync.

Every rejection (corrupt bytes, wrong version, unknown name, bad shape, non-finite value,
gap in a delta chain) raises :class:`SyncError` with a message naming the problem, so a
caller can log it and fall back to a full "anchor" refit. Only the standard library is
imported.
"""

from __future__ import annotations

__all__ = ["SyncError"]


class SyncError(ValueError):
    """A sketch delta was rejected; nothing was modified.

    ``kind`` is a short machine-readable tag (``checksum``, ``format_version``, ``truncated``,
    ``malformed``, ``unreadable``, ``keys``, ``dtype``, ``shape``, ``version``, ``replay``, ``gap``,
    ``name``, ``nonfinite``, ``layout``, ``precision``, ``exists``, ``apply``, ``config``, ``anchor``:
    a directory consumer is past a trainer refit or restart it has not verified); the message says
    the rest (``message``: the text after the ``[kind]`` prefix of ``str(error)``).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        self.message = message

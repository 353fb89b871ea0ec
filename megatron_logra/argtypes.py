"""``argparse`` value types shared by the benchmark and tool scripts.

A bad value is an ``argparse.ArgumentTypeError``, so the parser refuses it the way argparse
refuses any bad option: exit status 2 and one ``<prog>: error: argument --name: ...`` line.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["positive_int", "key_json"]


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def key_json(text: str) -> tuple[str, object]:
    """``KEY=JSON`` (e.g. an ``--engine-arg``): the key and the value parsed as JSON."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=JSON, e.g. attention_backend='\"triton\"'")
    try:
        return key.strip(), json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the value after = is not JSON ({exc})") from None

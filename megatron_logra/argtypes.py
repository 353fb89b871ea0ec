"""``argparse`` value types shared by the benchmark and tool scripts.

A bad value is an ``argparse.ArgumentTypeError``, so the parser refuses it the way argparse
refuses any bad option: exit status 2 and one ``<prog>: error: argument --name: ...`` line.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["positive_int", "key_json", "report_failed_run"]


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


def report_failed_run(parser: argparse.ArgumentParser, what: str, returncode: int, stderr: str) -> int:
    """A script's child run (``what``, e.g. ``megatron-logra train tiny``) exited ``returncode``.

    Status 2 is the CLI refusing a value: ``parser.error`` repeats its one-line reason (exit 2, as
    the CLI). Anything else: the last 20 lines of the child's ``stderr`` and the failure go to
    stderr, and the script's exit status 1 is returned.
    """
    tail = [line for line in stderr.splitlines() if line.strip()][-20:]
    if returncode == 2:
        last = tail[-1] if tail else "(no error message)"
        parser.error(f"{what}: {last.removeprefix('megatron-logra: error: ')}")
    sys.stderr.write("\n".join([*tail, f"{parser.prog}: {what} failed with exit code {returncode}"]) + "\n")
    return 1

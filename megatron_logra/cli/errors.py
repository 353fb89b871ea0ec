"""How the CLI reports bad input: ``megatron-logra: error: ...`` and exit status 2, without a traceback, once per
multi-process launch.

:data:`USER_ERRORS` are the exceptions that mean bad input; :func:`user_error` and :func:`reporting_user_errors`
turn them into that report (``MEGATRON_LOGRA_TRACEBACK=1`` re-raises them instead), and :class:`Parser`, the
command line's parser, writes its own errors and those reports through :func:`exit_with_error`, which lets rank 0
of a torchrun launch report an error that every rank meets while the other ranks stay silent.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from typing import Callable, Optional, TypeVar

from megatron_logra.cli.launch import peer_rank

__all__ = ["REPORT_GRACE_SECONDS", "REPORTED_SETTLE_SECONDS", "USER_ERRORS", "Parser", "exit_with_error",
           "reporting_user_errors", "tracebacks_wanted", "user_error"]

T = TypeVar("T")

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
"""Errors that mean bad input (a config value, a path, a checkpoint -- ``CheckpointError`` is a
``ValueError``): reported as ``megatron-logra: error: ...`` with exit status 2, no traceback.
``MEGATRON_LOGRA_TRACEBACK=1`` re-raises them (for debugging)."""


def tracebacks_wanted() -> bool:
    """``MEGATRON_LOGRA_TRACEBACK`` is set to something other than ``""`` / ``0``."""
    return os.environ.get("MEGATRON_LOGRA_TRACEBACK", "") not in ("", "0")


def user_error(parser: argparse.ArgumentParser, exc: BaseException) -> typing.NoReturn:
    """Bad input ``exc`` -> ``megatron-logra: error: ...``, exit status 2; with ``MEGATRON_LOGRA_TRACEBACK=1``
    re-raised instead (call it in the ``except`` block that caught ``exc``)."""
    if tracebacks_wanted():
        raise exc
    parser.error(str(exc))


def reporting_user_errors(parser: argparse.ArgumentParser, fn: Callable[[], T]) -> T:
    """``fn()``; one of :data:`USER_ERRORS` raised by it is reported as ``PROG: error: ...`` (without the usage
    line) with exit status 2, or re-raised with ``MEGATRON_LOGRA_TRACEBACK=1``. Other exceptions propagate."""
    try:
        return fn()
    except USER_ERRORS as exc:
        if tracebacks_wanted():
            raise
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


REPORT_GRACE_SECONDS = 10.0
"""How long a rank other than 0 of a multi-process launch waits, silent, before it reports an error that made it
stop (:func:`exit_with_error`): rank 0 meets the same error and reports it, and the launcher (torchrun) stops
the other ranks as soon as one has failed."""


REPORTED_SETTLE_SECONDS = 2.0
"""How long a rank other than 0 that saw rank 0's report announced still waits before it exits (the launcher
stopping it sooner on rank 0's node), so that rank 0 ends first and the launcher names it as the failure."""


def exit_with_error(status: int, message: str) -> typing.NoReturn:
    """Write ``message`` (an error report, ending in a newline) to stderr and exit with ``status``, once per launch.

    Every rank of a multi-process launch parses the same command line and config, so a refused config or
    override fails on all of them alike: rank 0 (and a process without a launcher) reports it at once, and the
    other ranks wait silently for up to :data:`REPORT_GRACE_SECONDS` so that rank 0 reports it first. A launcher
    that stops the remaining ranks once one has failed (torchrun does, with SIGTERM) then ends them during that
    wait: they exit with the same ``status``, without a word. A rank still running after the wait (an error that
    rank 0 did not meet, e.g. a path missing on that rank's node only, or a launcher that stops nobody) reports
    its error itself. The ranks of other nodes, whose torchrun learns of the failure later, do not wait for it:
    rank 0 announces its report in the store torchrun's agent shares with every node
    (:func:`megatron_logra.launch_store.announce_error_reported`), and a rank that sees it during the wait exits
    with ``status`` without a word (:func:`megatron_logra.launch_store.rank0_reported_error`), so the error
    appears once per launch, not once per node."""
    import signal
    import time

    from megatron_logra.launch_store import announce_error_reported, rank0_reported_error

    def stopped(signum, frame) -> None:  # the launcher ends this rank: another one has failed (rank 0 reported)
        os._exit(status)

    if peer_rank() is not None:
        signal.signal(signal.SIGTERM, stopped)
        signal.signal(signal.SIGINT, stopped)
        if rank0_reported_error(REPORT_GRACE_SECONDS):  # rank 0, on whichever node, has reported it
            time.sleep(REPORTED_SETTLE_SECONDS)  # rank 0 ends first: the launcher names it the first failure
            sys.stdout.flush()
            os._exit(status)  # not sys.exit: the launcher's SIGTERM during interpreter shutdown would end it by signal
    sys.stderr.write(message)
    sys.stderr.flush()
    if peer_rank() is None:  # rank 0 (or one process): the others stop silently once they see the announcement
        signal.signal(signal.SIGTERM, stopped)  # and the launcher may stop this rank as it exits: the same status
        signal.signal(signal.SIGINT, stopped)
        announce_error_reported(REPORT_GRACE_SECONDS)  # until the others have seen it, at most as long as they wait
    sys.exit(status)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors (a bad argument, a refused config or override) are reported once
    per multi-process launch (:func:`exit_with_error`)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.format_usage()}{self.prog}: error: {message}\n")

    def exit(self, status: int = 0, message: Optional[str] = None) -> typing.NoReturn:
        if status == 0 or not message:
            super().exit(status, message)
        exit_with_error(status, message)

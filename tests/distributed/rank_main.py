"""The body of a torchrun worker script's entry point, shared by the scripts in this folder."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable


def rank_main(run: Callable[[], None]) -> int:
    """``run()`` on this rank, then tear down the process groups; returns the exit status 0.

    A failure prints its traceback and ends the process at once (``os._exit(1)``): a failed rank
    cannot leave its peers waiting in a collective forever. ``OMP_NUM_THREADS`` defaults to 1.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    from megatron_logra.parallel import destroy_parallel

    destroy_parallel()
    return 0

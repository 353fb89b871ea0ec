"""Worker for ``test_early_stop_agreement.py``: two ranks agree on stopping when only one has a reason.

Launch: ``torchrun --nproc-per-node 2 early_stop_worker.py OUT``. Round 1: nobody has a reason.
Round 2: only rank 1 receives SIGTERM. Then, in a second stop object, only rank 0's wall-time budget
is spent. Each rank writes what its checks returned to ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist


def main(out: str) -> None:
    from megatron_logra.train.stopping import STOP_SIGNAL, EarlyStop

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    with EarlyStop(signal_handler=True, duration_minutes=0) as stop:
        results.append(stop.check())
        if rank == 1:
            os.kill(os.getpid(), STOP_SIGNAL)
        results.append(stop.check())
    start = time.monotonic() - (600 if rank == 0 else 0)  # rank 0 has been running for 10 minutes
    results.append(EarlyStop(signal_handler=False, duration_minutes=5, start=start).check())
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checks": results}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

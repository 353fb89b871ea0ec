"""The warm launcher the distributed tests use stands in for torchrun faithfully.

A rank forked by ``support.forked`` must see what a rank torchrun starts sees (the rendezvous
variables, a fresh ``__main__``, its own argv, the working directory, one thread, the test
environment), and a launch must fail as torchrun's does when one rank fails, without waiting on
a peer that would block forever.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.distributed

PROBE = '''
import json, os, sys
import torch
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "PYTHONWARNINGS"]
record = json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "name": __name__,
                     "cwd": os.getcwd(), "threads": torch.get_num_threads(), "port_set": "MASTER_PORT" in os.environ,
                     "script_dir_on_path": os.path.dirname(os.path.abspath(__file__)) == sys.path[0]})
# one write of the whole line (atomic on a pipe below PIPE_BUF): the ranks share torchrun's stdout, and print()
# unbuffered writes the text and its newline apart, so two ranks' records could run into one line
os.write(1, (record + "\\n").encode())
'''

FAIL_ONE = '''
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit("rank 1 refuses")
time.sleep(600)  # a peer blocked in a collective that will never complete
'''


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("nproc", [1, 2])
def test_forked_ranks_see_what_torchrun_ranks_see(launcher, tmp_path, nproc):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cold = _records(launcher.launch(nproc, [str(script), "a", "--b"], cold=True).stdout)
    warm = _records(launcher.launch(nproc, [str(script), "a", "--b"]).stdout)
    assert len(cold) == len(warm) == nproc
    key = (lambda r: r["env"]["RANK"] or "")
    for c, w in zip(sorted(cold, key=key), sorted(warm, key=key)):
        assert c == w
    assert sorted(r["env"]["RANK"] for r in warm) == ([None] if nproc == 1 else ["0", "1"])
    assert all(r["name"] == "__main__" and r["argv"] == ["a", "--b"] and r["threads"] == 1 for r in warm)
    assert all(r["port_set"] == (nproc > 1) and r["script_dir_on_path"] for r in warm)


def test_one_failing_rank_fails_the_launch_and_stops_the_others(launcher, tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(FAIL_ONE)
    t0 = time.monotonic()
    proc = launcher.launch(2, [str(script)], check=False, timeout=120)
    assert time.monotonic() - t0 < 60, "the blocked peer was not stopped"
    assert proc.returncode != 0
    assert "rank 1 refuses" in proc.stderr

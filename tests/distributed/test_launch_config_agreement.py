"""Ranks of one launch given different arguments are refused before anything is built.

A launch script whose per-node line differs (or a node with another recipe file) gives its ranks different
configs: each would build another model or optimizer and fail deep inside a collective (gloo aborts in C++
with "Is there a distributed collective mismatch", NCCL waits until ``parallel.timeout_minutes``). ``train``
and ``eval`` compare every rank's resolved config with rank 0's first and stop with one error line naming the
field, both values and the fix, exit status 2, without creating the run directory.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = '''\
import os
import sys

from megatron_logra.cli import main

rank = int(os.environ["RANK"])
args = [a.replace("RANK_DEPENDENT", str(8 + 8 * rank)) for a in sys.argv[1:]]
sys.exit(main(args))
'''
"""The CLI with ``RANK_DEPENDENT`` in its arguments replaced by 8 on rank 0 and 16 on rank 1."""


def test_ranks_with_different_overrides_get_one_error_naming_the_field(launcher, tmp_path):
    script = tmp_path / "per_rank_cli.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    proc = launcher.launch(2, [str(script), "train", "lm-tiny", "train.steps=2", f"train.run_dir={run}",
                               "logra.rank=RANK_DEPENDENT"], check=False, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("megatron-logra: error:") == 1, proc.stderr[-3000:]
    assert "optimizer.logra.rank=16 on rank 1, 8 on rank 0" in proc.stderr, proc.stderr[-3000:]
    assert "start every rank with the same arguments" in proc.stderr, proc.stderr[-3000:]
    assert "collective mismatch" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not run.exists()


def test_ranks_with_the_same_config_train_and_eval(launcher, tmp_path):
    run = tmp_path / "run"
    launcher.launch(2, ["-m", "megatron_logra.cli", "train", "lm-tiny", "train.steps=2", f"train.run_dir={run}",
                        "--tensor-model-parallel-size", "2"], timeout=180)
    script = tmp_path / "per_rank_cli.py"
    script.write_text(SCRIPT)
    proc = launcher.launch(2, [str(script), "eval", str(run), "train.eval_sequences=RANK_DEPENDENT"], check=False,
                           timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.eval_sequences=16 on rank 1, 8 on rank 0" in proc.stderr, proc.stderr[-3000:]


def test_paths_into_the_package_compare_relative_to_each_ranks_install():
    # the shipped recipes' tokenizer.path / sft.init_path are absolute paths into the installed package, which
    # nodes may hold at other paths: those compare equal, any other path as written
    from pathlib import Path

    import megatron_logra
    from megatron_logra.cli.launch import _package_relative
    from megatron_logra.config import load_recipe

    root = Path(megatron_logra.__file__).resolve().parent
    shipped = _package_relative(load_recipe("tiny").sft.init_path)
    assert shipped == "<megatron_logra>/assets/warm_start_tiny/model.safetensors"
    assert _package_relative(str(root) + "_other/x") == str(root) + "_other/x"
    assert _package_relative("/ckpt/Qwen2.5-7B") == "/ckpt/Qwen2.5-7B" and _package_relative(3) == 3

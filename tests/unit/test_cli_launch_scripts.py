"""The GPU launch scripts (``examples/*.sh`` via ``examples/gpu_impl.bash``): ``FP8=...`` selects the
TransformerEngine spec by itself and is refused with ``IMPL=local`` (it was dropped without a word unless
``IMPL=transformer_engine`` was set too, so the run trained in bf16). ``torchrun`` is a stub on ``PATH``
that prints its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = {"train_1.5b_1gpu.sh": {}, "train_27b_8gpu.sh": {},
           "train_7b_multinode.sh": {"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _launch(tmp_path, script, **env):
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "torchrun").write_text('#!/bin/sh\necho "torchrun $*"\n')
    (stub / "torchrun").chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in ("IMPL", "FP8", "DATA", "EVAL_DATA")}
    full.update(PATH=f"{stub}{os.pathsep}{os.environ.get('PATH', '')}", HF_PATH="/ckpt/x", **SCRIPTS[script], **env)
    return subprocess.run(["bash", str(EXAMPLES / script)], env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_fp8_alone_selects_the_te_spec(tmp_path, script):
    out = _launch(tmp_path, script, FP8="hybrid")
    assert out.returncode == 0, out.stderr
    assert "model.transformer_impl=transformer_engine" in out.stdout and "model.fp8=hybrid" in out.stdout
    both = _launch(tmp_path, script, FP8="e4m3", IMPL="transformer_engine")
    assert both.returncode == 0 and "model.fp8=e4m3" in both.stdout


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_fp8_with_the_local_spec_is_refused(tmp_path, script):
    out = _launch(tmp_path, script, FP8="hybrid", IMPL="local")
    assert out.returncode == 2 and "torchrun" not in out.stdout
    assert "FP8=hybrid needs IMPL=transformer_engine" in out.stderr


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_without_fp8_the_spec_is_unchanged(tmp_path, script):
    out = _launch(tmp_path, script)
    assert out.returncode == 0 and "model.transformer_impl" not in out.stdout and "model.fp8" not in out.stdout
    te = _launch(tmp_path, script, IMPL="transformer_engine")
    assert "model.transformer_impl=transformer_engine" in te.stdout and "model.fp8" not in te.stdout


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_data_and_eval_data_set_the_task(tmp_path, script):
    out = _launch(tmp_path, script, DATA="jsonl:/data/train.jsonl,gcd", EVAL_DATA="parquet:/data/test.parquet")
    assert out.returncode == 0, out.stderr
    assert "task.datasets=jsonl:/data/train.jsonl,gcd" in out.stdout
    assert "task.eval_datasets=parquet:/data/test.parquet" in out.stdout
    assert "task." not in _launch(tmp_path, script).stdout


def test_the_multinode_launcher_takes_its_layout_from_slurm(tmp_path):
    """``srun bash examples/train_7b_multinode.sh`` inside an sbatch job: NNODES, NODE_RANK and MASTER_ADDR
    default to the job's node count, this node's index and its first host; variables given still win."""
    _launch(tmp_path, "train_1.5b_1gpu.sh")  # writes the torchrun stub
    stub = tmp_path / "bin"
    (stub / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n')
    (stub / "scontrol").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("IMPL", "FP8", "NNODES", "NODE_RANK", "MASTER_ADDR")}
    base.update(PATH=f"{stub}{os.pathsep}{os.environ.get('PATH', '')}", HF_PATH="/ckpt/x")
    slurm = dict(SLURM_JOB_ID="42", SLURM_NNODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu[07-08]")

    def run(**env):
        return subprocess.run(["bash", str(EXAMPLES / "train_7b_multinode.sh")], env=dict(base, **env),
                              capture_output=True, text=True, timeout=60)

    out = run(**slurm)
    assert out.returncode == 0, out.stderr
    assert "--nnodes 2 --node-rank 1 --master-addr gpu07 --master-port 29500" in out.stdout
    given = run(**slurm, NODE_RANK="0", MASTER_ADDR="10.1.1.1")
    assert "--nnodes 2 --node-rank 0 --master-addr 10.1.1.1" in given.stdout
    bare = run()
    assert bare.returncode != 0 and "set NNODES" in bare.stderr  # outside Slurm they stay required

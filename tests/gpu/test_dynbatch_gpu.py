"""Dynamic micro-batches (``rl.max_tokens_per_micro_batch``) on a GPU: the step's gradient sketches equal those of
fixed micro-batches (bf16 model: to bf16 accuracy), and the RL job runs with a token budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")]

ROOT = Path(__file__).resolve().parents[2]


def test_a_token_budget_gives_the_fixed_micro_batches_sketches_on_gpu(tmp_path):
    from support.dynbatch import largest_sketch_difference, skewed_batch, step_parts
    from support.run_fixtures import rl_components

    with rl_components(tmp_path / "run", ["rl.prompts_per_step=4", "rl.group_size=4", "rl.micro_batch_size=4",
                                          "task.num_eval=0", "model.params_dtype=bfloat16"]) as (comps, _):
        assert next(comps.model.parameters()).is_cuda
        batch = skewed_batch(comps, [40, 3, 2, 5, 1, 36, 4, 3, 0, 6, 2, 4])
        fixed, dyn = step_parts(comps, batch, 0), step_parts(comps, batch, 64)
        assert dyn["positions"] < fixed["positions"] / 2
        assert fixed["result"].num_tokens == dyn["result"].num_tokens
        assert largest_sketch_difference(fixed["sketches"], dyn["sketches"]) < 3e-2  # bf16 activations


def test_rl_job_runs_with_a_token_budget_on_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_logra.cli", "train", "tiny", "rl.steps=2",
                           "rl.eval_interval=0", "rl.max_tokens_per_micro_batch=256", f"train.run_dir={tmp_path}",
                           "train.progress=false"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and not any(r["skipped"] for r in records)

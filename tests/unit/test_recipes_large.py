"""The GPU recipes fit their own memory preflight on 80 GB GPUs (``train.memory_check`` plans
``rl.micro_batch_size × model.seq_length``): ``qwen2.5-1.5b`` at micro-batch 8 was OOM by 6.3% on one H100,
so every launch of ``examples/train_1.5b_1gpu.sh`` warned and ``train.memory_check=error`` refused it. The
figures are the ones the recipes' docstring, README and docs/memory.md quote; the references are the
planner called as ``megatron-logra memory`` would be, independently of the preflight's mapping."""

from __future__ import annotations

import pytest

from megatron_logra.config import RECIPES
from megatron_logra.memory import PlanConfig, plan
from megatron_logra.memory.preflight import memory_preflight
from megatron_logra.memory.units import GiB, parse_bytes
from megatron_logra.models.presets import get_preset
from megatron_logra.overrides import parse_args_to_config

H100 = parse_bytes("81559MiB")


@pytest.mark.parametrize("name, tp, dp, micro_batch, total_gib, headroom", [
    ("qwen2.5-1.5b", 1, 1, 4, 61.72, 0.225),   # examples/train_1.5b_1gpu.sh
    ("qwen2.5-1.5b", 1, 8, 4, 61.72, 0.225),   # GPUS=8: data-parallel, the same per GPU
    ("qwen2.5-7b", 4, 2, 4, 53.29, 0.331),
    ("27b", 8, 1, 2, 57.40, 0.279),
])
def test_each_gpu_recipe_fits_its_own_preflight_on_80_gb(name, tp, dp, micro_batch, total_gib, headroom):
    cfg = parse_args_to_config(name, ["train.memory_check=error"])
    assert (cfg.parallel.tp, cfg.rl.micro_batch_size, cfg.model.seq_length, cfg.model.recompute) == \
        (tp, micro_batch, 4096, "full")
    got = memory_preflight(cfg, tp=tp, pp=1, dp=dp, gpu_memory_bytes=H100)  # error mode: raises if it did not fit
    want = plan(get_preset(name), PlanConfig(tp=tp, dp=dp, rank=128, recompute="full", engine_fraction=0.3,
                                             micro_batch=micro_batch, seq_len=4096, gpu_memory_bytes=H100,
                                             distributed_optimizer=False))
    assert got is not None and got.fits and got.headroom >= 0.15
    assert got.worst.total == want.worst.total
    assert got.worst.total / GiB == pytest.approx(total_gib, abs=0.005)
    assert got.headroom == pytest.approx(headroom, abs=0.0005)


def test_the_old_1_5b_micro_batch_did_not_fit():
    """What the docs quote for micro-batch 8 (the reason for 4)."""
    got = plan(get_preset("qwen2.5-1.5b"), PlanConfig(tp=1, rank=128, recompute="full", engine_fraction=0.3,
                                                      micro_batch=8, seq_len=4096, gpu_memory_bytes=H100,
                                                      distributed_optimizer=False))
    assert not got.fits and got.headroom == pytest.approx(-0.063, abs=0.0005)
    assert got.worst.total / GiB == pytest.approx(84.66, abs=0.005)


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen2.5-7b", "27b"])
def test_the_recipe_line_names_its_layout(name):
    cfg = RECIPES[name]()
    doc = RECIPES[name].__doc__
    assert f"TP {cfg.parallel.tp}, micro-batch {cfg.rl.micro_batch_size}," in doc

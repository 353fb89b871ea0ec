"""Batch sizes the parallel layout cannot split evenly are refused before anything is built.

``rl.config.check_rl_batch_layout(cfg, dp_size, pp_size)`` (a pure function, no process group):

* ``rl.prompts_per_step`` (and ``sft.batch_size`` when the warm start trains) must divide over the
  data-parallel ranks; before, the remainder was dropped silently (``prompts // dp``), a DP size
  above the prompt count crashed obscurely, and the warm start truncated or overlapped its batches
  (``max(1, batch_size // dp)``).
* With pipeline parallelism each rank's rows must form micro-batches of one shape: the schedule
  takes the first micro-batch's shape for all (a ragged last one crashed: "labels of shape (1, 32)
  do not match logits (3, 32, 160)"). One pipeline stage keeps accepting a smaller last micro-batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_logra.config import RunConfig, tiny
from megatron_logra.rl.batching import split_microbatches
from megatron_logra.rl.config import check_rl_batch_layout, share_per_rank
from megatron_logra.train.step import Batch


def _cfg(prompts: int = 16, group: int = 8, micro: int = 64, sft_batch: int = 64, sft_steps: int = 0) -> RunConfig:
    cfg = tiny()
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.micro_batch_size = prompts, group, micro
    cfg.sft.batch_size, cfg.sft.steps, cfg.sft.init_path = sft_batch, sft_steps, ""
    return cfg


@pytest.mark.parametrize("prompts, dp, hint", [(3, 2, "e.g. 4"), (16, 3, "e.g. 18"), (2, 4, "e.g. 4")],
                         ids=["remainder", "remainder-dp3", "dp-above-prompts"])
@pytest.mark.parametrize("pp", [1, 2])
def test_prompts_per_step_must_divide_over_dp(prompts, dp, hint, pp):
    with pytest.raises(ValueError) as err:
        check_rl_batch_layout(_cfg(prompts=prompts), dp, pp)
    msg = str(err.value)
    assert msg.startswith(f"rl.prompts_per_step={prompts} is not divisible by the data-parallel size {dp}")
    assert f"multiple of {dp} ({hint})" in msg


@pytest.mark.parametrize("prompts, dp", [(16, 1), (16, 2), (16, 4), (4, 4), (3, 1)])
def test_even_prompt_splits_pass(prompts, dp):
    check_rl_batch_layout(_cfg(prompts=prompts, group=4, micro=4), dp, 1)
    assert share_per_rank("rl.prompts_per_step", prompts, dp, "prompts") == prompts // dp


@pytest.mark.parametrize("sft_batch, dp", [(63, 2), (2, 4)])
def test_sft_batch_size_must_divide_over_dp_when_the_warm_start_trains(sft_batch, dp):
    with pytest.raises(ValueError, match=rf"^sft\.batch_size={sft_batch} is not divisible by the data-parallel "
                                         rf"size {dp}.*set sft\.batch_size to a multiple of {dp}"):
        check_rl_batch_layout(_cfg(prompts=4, sft_batch=sft_batch, sft_steps=10), dp, 1)
    # no warm-start training: sft.batch_size is never used, so it is not checked
    for change in ({"steps": 0}, {"init_path": "warm.safetensors"}):
        cfg = _cfg(prompts=4, sft_batch=sft_batch, sft_steps=10)
        for key, value in change.items():
            setattr(cfg.sft, key, value)
        check_rl_batch_layout(cfg, dp, 1)
    cfg = _cfg(prompts=4, sft_batch=sft_batch, sft_steps=10)
    cfg.model.hf_path = "/some/checkpoint"
    check_rl_batch_layout(cfg, dp, 1)


def test_ragged_micro_batches_are_refused_under_pipeline_parallelism_only():
    # 8 prompts over 2 DP ranks × 3 samples = 12 rows per rank: micro-batches of 5 would be 5, 5, 2
    cfg = _cfg(prompts=8, group=3, micro=5)
    check_rl_batch_layout(cfg, 2, 1)  # one stage: a smaller last micro-batch is fine
    with pytest.raises(ValueError) as err:
        check_rl_batch_layout(cfg, 2, 2)
    msg = str(err.value)
    assert msg.startswith("rl.micro_batch_size=5 does not split the 12 sequences each data-parallel rank")
    assert "rl.prompts_per_step=8 / data-parallel size 2 × rl.group_size=3" in msg
    assert "pipeline-parallel size 2" in msg
    assert "divisor of 12 (e.g. 4) or to 12 or more" in msg
    assert "change rl.prompts_per_step or rl.group_size" in msg


def test_ragged_warm_start_micro_batches_are_refused_under_pipeline_parallelism():
    cfg = _cfg(prompts=4, group=4, micro=24, sft_batch=64, sft_steps=10)  # 32 demonstrations per rank: 24 + 8
    check_rl_batch_layout(cfg, 2, 1)
    with pytest.raises(ValueError, match=r"^rl\.micro_batch_size=24 does not split the 32 sequences .*"
                                         r"sft\.batch_size=64 / data-parallel size 2.*change sft\.batch_size"):
        check_rl_batch_layout(cfg, 2, 2)


def _rows(n: int) -> Batch:
    t = torch.zeros(n, 1)
    return Batch(tokens=t.long(), labels=t.long(), loss_mask=t, position_ids=t.long())


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_pipeline_check_accepts_exactly_the_layouts_with_equal_micro_batches(pp):
    """Over a grid of layouts, ``check_rl_batch_layout`` passes exactly when ``rl.prompts_per_step`` divides
    over DP and, with more than one stage, ``split_microbatches`` of a rank's rows yields one shape."""
    for dp in (1, 2, 3):
        for prompts in range(1, 9):
            for group in (1, 3, 4):
                for micro in range(1, 14):
                    uniform = len({b.tokens.shape for b in split_microbatches(_rows(prompts // dp * group), micro)}) == 1
                    ok = prompts % dp == 0 and (pp == 1 or uniform)
                    try:
                        check_rl_batch_layout(_cfg(prompts=prompts, group=group, micro=micro), dp, pp)
                        refused = None
                    except ValueError as exc:
                        refused = str(exc)
                    assert (refused is None) == ok, (dp, prompts, group, micro, refused)


def test_the_pipeline_recipes_of_the_distributed_tests_still_pass():
    """``tiny`` at pp = 2 with 4 prompts × 4 samples (one micro-batch of 16 rows under 64) stays valid."""
    cfg = tiny()
    cfg.rl.prompts_per_step, cfg.rl.group_size = 4, 4
    check_rl_batch_layout(cfg, 1, 2)
    check_rl_batch_layout(tiny(), 2, 2)


def test_run_sft_refuses_an_uneven_batch_before_building_anything():
    from megatron_logra.rl.sft import run_sft

    def demos(index):
        raise AssertionError("no demonstration may be drawn")

    with pytest.raises(ValueError, match=r"^sft\.batch_size=3 is not divisible by the data-parallel size 2"):
        run_sft(None, SimpleNamespace(dp_size=2, dp_rank=0), demos, steps=1, batch_size=3, lr=1e-3,
                micro_batch_size=4, pad_id=0, max_length=16)


def test_build_components_refuses_before_building_anything(monkeypatch, tmp_path):
    """The check runs right after the process groups exist, on every rank, before the memory
    preflight, the run directory or any model."""
    import megatron_logra.rl.components as job
    import megatron_logra.rl.task_setup as task_setup

    def too_far(*args, **kwargs):
        raise AssertionError("build_components went past the batch layout check")

    monkeypatch.setattr(job, "initialize_parallel", lambda *a, **k: SimpleNamespace(dp_size=2, pp_size=1, tp_size=1))
    for name in ("memory_preflight", "claim_run_dir", "build_gpt"):
        monkeypatch.setattr(job, name, too_far)
    monkeypatch.setattr(task_setup, "build_task", too_far)  # the task is built by rl.task_setup
    cfg = _cfg(prompts=3)
    cfg.train.run_dir = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"^rl\.prompts_per_step=3 is not divisible by the data-parallel size 2"):
        job.build_components(cfg)
    assert not (tmp_path / "run").exists()

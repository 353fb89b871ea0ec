"""Sequence lengths under FP8 GEMMs and sequence parallelism.

TransformerEngine checks the *local* token count of every FP8 GEMM input (before the
sequence-parallel all-gather) against a multiple of 16 (32 for MXFP8), and sequence parallelism splits each
sequence over the TP group. RL therefore pads every step's sequences to ``sequence_multiple``
(capped at ``model.seq_length``, which must be a multiple too), and configs that cannot meet it
are refused when they are built, naming the field.
"""

from __future__ import annotations

import pytest
from megatron.core.enums import Fp8Recipe
from megatron.core.fp8_utils import get_fp8_align_size

from megatron_logra.models.te import FP8_RECIPES, sequence_multiple
from megatron_logra.config import apply_overrides, load_recipe
from megatron_logra.rl.batching import pack_sequences


@pytest.mark.parametrize("fp8, sp, tp, recipe", [
    (None, False, 1, "delayed"), (None, False, 8, "delayed"), (None, True, 1, "delayed"), (None, True, 2, "delayed"),
    (None, True, 3, "delayed"), (None, True, 16, "delayed"), ("hybrid", False, 4, "delayed"),
    ("e4m3", True, 1, "delayed"), ("hybrid", True, 8, "delayed"), ("hybrid", False, 1, "mxfp8"),
    ("hybrid", True, 4, "mxfp8"), ("e4m3", True, 2, "tensorwise"), ("hybrid", False, 2, "blockwise")])
def test_every_rank_gets_whole_sequences_and_fp8_sized_token_counts(fp8, sp, tp, recipe):
    align = get_fp8_align_size(Fp8Recipe(recipe))  # megatron-core's own figure for the recipe
    m = sequence_multiple(fp8, sp, tp, recipe)
    assert m % 8 == 0
    ranks = tp if sp else 1
    for s in range(m, 8 * m + 1, m):
        assert s % ranks == 0  # the sequence splits over the sequence-parallel ranks
        if fp8:
            assert (s // ranks) % align == 0  # each rank's tokens of one sequence, so any micro-batch size works
    smaller = [d for d in range(8, m, 8) if m % d == 0 and d % ranks == 0 and (not fp8 or (d // ranks) % align == 0)]
    assert smaller == []  # and it is the smallest such multiple of 8


def test_every_fp8_recipe_is_one_megatron_core_knows():
    assert {Fp8Recipe(r).value for r in FP8_RECIPES} == set(FP8_RECIPES)


def _pack(completion_len, max_length, multiple):
    return pack_sequences([[1, 2, 3]], [[4] * completion_len], rollout_logprobs=[[0.0] * completion_len],
                          advantages=[1.0], finished=[True], pad_id=0, max_length=max_length, multiple=multiple)


def test_rl_batches_are_padded_to_the_multiple_and_capped_at_the_context():
    assert _pack(5, 256, 8).tokens.shape == (1, 8)  # 3 + 5 - 1 = 7 positions
    assert _pack(5, 256, 128).tokens.shape == (1, 128)
    assert _pack(130, 256, 128).tokens.shape == (1, 256)
    assert _pack(5, 60, 8).tokens.shape == (1, 8) and _pack(57, 60, 8).tokens.shape == (1, 60)  # historical cap
    with pytest.raises(ValueError, match="max_length=200 is not a multiple of 128"):
        _pack(5, 200, 128)


def test_configs_that_cannot_meet_the_multiple_are_refused_naming_the_field():
    fp8_sp = ["model.transformer_impl=auto", "model.fp8=hybrid", "model.sequence_parallel=true", "parallel.tp=2"]
    with pytest.raises(ValueError, match=r"model\.seq_length=48 must be a multiple of 32.*round it to 64"):
        apply_overrides(load_recipe("tiny"), fp8_sp)
    cfg = apply_overrides(load_recipe("tiny"), fp8_sp + ["model.seq_length=64"])
    assert cfg.sequence_multiple() == 32
    assert load_recipe("tiny").sequence_multiple() == 8

    fp8 = ["model.transformer_impl=auto", "model.fp8=hybrid"]
    assert apply_overrides(load_recipe("lm-tiny"), fp8).train.micro_batch_size == 16  # 13 tokens × 16
    with pytest.raises(ValueError, match=r"train\.micro_batch_size=8: FP8 needs each rank's 13×8 tokens"):
        apply_overrides(load_recipe("lm-tiny"), fp8 + ["train.micro_batch_size=8"])
    with pytest.raises(ValueError, match=r"train\.micro_batch_size=16: FP8 needs each rank's 13×16 tokens.*multiple "
                                         r"of 32 .*model\.fp8_recipe=mxfp8"):
        apply_overrides(load_recipe("lm-tiny"), fp8 + ["model.fp8_recipe=mxfp8"])
    assert apply_overrides(load_recipe("lm-tiny"), fp8 + ["model.fp8_recipe=mxfp8", "train.micro_batch_size=32"])

    mx = ["model.transformer_impl=auto", "model.fp8=hybrid", "model.fp8_recipe=mxfp8"]
    with pytest.raises(ValueError, match=r"model\.seq_length=48 must be a multiple of 32.*round it to 64"):
        apply_overrides(load_recipe("tiny"), mx + ["model.seq_length=48"])
    assert apply_overrides(load_recipe("tiny"), mx + ["model.seq_length=64"]).sequence_multiple() == 32
    with pytest.raises(ValueError, match=r"data\.content_length=6.*sequence-parallel"):
        apply_overrides(load_recipe("lm-tiny"), ["model.transformer_impl=auto", "model.sequence_parallel=true",
                                                 "parallel.tp=2"])

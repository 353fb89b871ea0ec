"""Whitening of the step's advantages (``rl.advantage.normalize``, slime's ``--normalize-advantages``): the pure
core in ``rl.advantages`` against a naive reference that expands every sequence's advantage over its loss tokens
and takes ``torch.mean`` / ``torch.std`` (unbiased) in float64; the degenerate batches; the config field."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.rl.advantages import (WHITEN_EPS, AdvantageConfig, grpo_advantages, masked_whiten,
                                          whiten_advantages, whiten_moments, whiten_statistics)


def _naive(values: torch.Tensor, counts: list[int], eps: float = WHITEN_EPS) -> torch.Tensor:
    """Each value repeated over its tokens; mean and Bessel-corrected std of those tokens, as slime's
    ``distributed_masked_whiten`` on one rank with the loss mask; a sequence of no token (no loss token to whiten)
    gets 0."""
    tokens = torch.cat([values[i].double().repeat(n) for i, n in enumerate(counts)])
    mean = tokens.mean()
    var = tokens.var(unbiased=True) if tokens.numel() > 1 else torch.zeros((), dtype=torch.float64)
    whitened = ((values.double() - mean) / torch.sqrt(var + eps)).to(values.dtype)
    return torch.tensor([w if n > 0 else 0.0 for w, n in zip(whitened.tolist(), counts)], dtype=values.dtype)


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_naive_token_expansion(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 40, (1,), generator=g))
    values = torch.randn(n, generator=g) * 3 + 0.7
    counts = torch.randint(0, 30, (n,), generator=g).tolist()
    counts[0] = max(counts[0], 1)  # at least one loss token
    got = masked_whiten(values, counts)
    torch.testing.assert_close(got, _naive(values, counts), rtol=1e-5, atol=1e-6)
    # token-weighted, not per sequence: the loss tokens' mean is 0 and their std 1
    tokens = torch.cat([got[i].double().repeat(c) for i, c in enumerate(counts)])
    assert abs(tokens.mean().item()) < 1e-5
    assert tokens.std().item() == pytest.approx(1.0, rel=1e-5)


def test_long_sequences_weigh_more_than_short_ones():
    values = torch.tensor([1.0, -1.0])
    got = masked_whiten(values, [3, 1])  # mean over tokens 0.5, not the sequences' 0
    torch.testing.assert_close(got, _naive(values, [3, 1]))
    assert got[0].item() == pytest.approx(0.5 / math.sqrt(1.0 + WHITEN_EPS))  # var (3·0.25 + 2.25) / 3 = 1


def test_sequences_without_tokens_do_not_count():
    values = torch.tensor([2.0, -5.0, 4.0, 100.0])
    got = masked_whiten(values, [2, 0, 2, 0])
    torch.testing.assert_close(got[[0, 2]], masked_whiten(values[[0, 2]], [2, 2]))
    assert got[[1, 3]].tolist() == [0.0, 0.0]


def test_a_sequence_without_tokens_does_not_hide_a_step_of_equal_advantages():
    """The sequences with tokens share one advantage and an empty completion differs: whitening gives exact zeros
    (the step is one of zero advantages, skipped as such), not a huge value for the sequence that trains on
    nothing."""
    got = masked_whiten(torch.tensor([0.1, 0.1, 0.1, 0.7]), [3, 5, 7, 0])
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_pre_reduced_statistics_of_shards_equal_the_whole_batch():
    g = torch.Generator().manual_seed(3)
    values, counts = torch.randn(12, generator=g), torch.randint(1, 9, (12,), generator=g).tolist()
    stats = whiten_statistics(values[:5], counts[:5]) + whiten_statistics(values[5:], counts[5:])
    whole = masked_whiten(values, counts)
    torch.testing.assert_close(torch.cat([masked_whiten(values[:5], counts[:5], stats),
                                          masked_whiten(values[5:], counts[5:], stats)]), whole)
    mean, var, tokens = whiten_moments(stats)
    expanded = torch.cat([values[i].double().repeat(c) for i, c in enumerate(counts)])
    assert tokens == sum(counts)
    assert (mean, var) == (pytest.approx(expanded.mean().item()), pytest.approx(expanded.var().item()))


def test_one_token_gives_zero_not_nan():
    assert masked_whiten(torch.tensor([3.5]), [1]).tolist() == [0.0]
    assert masked_whiten(torch.tensor([3.5, -2.0]), [1, 0]).tolist()[0] == 0.0


@pytest.mark.parametrize("value", [0.0, 0.3, -1.7, 1e4 / 3])
def test_all_equal_advantages_whiten_to_exact_zeros(value):
    values = torch.full((7,), value)
    got = masked_whiten(values, [1, 5, 9, 2, 33, 4, 1000])
    assert torch.equal(got, torch.zeros(7)), got  # exact: the step stays one of zero advantages
    # every group uniform under GRPO: zeros in, zeros out
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2)
    assert torch.equal(masked_whiten(adv, [3, 4, 5, 6]), torch.zeros(4))


def test_no_token_at_all_leaves_the_values():
    values = torch.tensor([0.5, -0.5])
    assert torch.equal(masked_whiten(values, [0, 0]), values)
    _, std = whiten_advantages(values, [0, 0], None)
    assert std is None


def test_uniform_groups_take_part_and_move_by_the_mean():
    """As slime (its mask is the loss mask alone): a uniform group's zero-advantage tokens count in the
    statistics and come out at −mean/std."""
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)  # group 2 uniform: advantage 0
    counts = [2, 6, 3, 3]
    got = masked_whiten(adv, counts)
    torch.testing.assert_close(got, _naive(adv, counts))
    mean, var, _ = whiten_moments(whiten_statistics(adv, counts))
    assert got[2].item() == got[3].item() == pytest.approx(-mean / math.sqrt(var + WHITEN_EPS))
    assert got[2].item() != 0.0


def test_one_process_helper_returns_the_raw_std_and_keeps_the_dtype():
    values = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float32)
    got, std = whiten_advantages(values, [2, 2, 4], None)
    assert got.dtype == torch.float32
    expanded = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    assert std == pytest.approx(expanded.std().item())
    torch.testing.assert_close(got, _naive(values, [2, 2, 4]))


def test_bad_token_counts_are_refused():
    with pytest.raises(ValueError, match="3 values but 2 token counts"):
        whiten_statistics(torch.zeros(3), [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        whiten_statistics(torch.zeros(2), [1, -1])


def test_config_field_defaults_off_and_is_validated():
    assert AdvantageConfig().normalize is False
    assert AdvantageConfig(normalize=True).normalize is True
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"rl\.advantage\.normalize="):
            AdvantageConfig(normalize=bad)


def test_config_field_is_set_by_an_override():
    from megatron_logra.config import parse_args_to_config

    cfg = parse_args_to_config("tiny", ["rl.advantage.normalize=true", "rl.advantage.estimator=reinforce"])
    assert cfg.rl.advantage.normalize is True
    assert parse_args_to_config("tiny", []).rl.advantage.normalize is False
    with pytest.raises(ValueError, match=r"rl\.advantage\.normalize"):
        parse_args_to_config("tiny", ["rl.advantage.normalize=maybe"])

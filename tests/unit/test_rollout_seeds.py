"""Seeds of rollout sampling: SGLang's per-request ``sampling_seed`` (``sglang_api.request_seeds``) and the
range of ``train.seed`` they derive from.

SGLang's deterministic sampler keeps per-request seeds in an int32 tensor and draws its Gumbel noise as a
hash of ``(seed, position, token)``: two requests with one seed at one position share their noise. The RL
loop gives DP rank ``r`` at step ``s`` the sampling seed ``train.seed * 1_000_003 + s * 1009 + r``
(``rl/loop.py``), so the seeds of one call must be unrelated to those of the neighbouring ranks' and steps'
calls, and must fit int32 for every ``train.seed`` the config accepts.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.config import TrainConfig
from megatron_logra.rollout.engine import SamplingParams
from megatron_logra.rollout.sglang_api import SEED_LIMIT, build_generate_payload, request_seeds


def loop_seed(train_seed: int, step: int, dp_rank: int) -> int:
    """The sampling seed rl/loop.py gives one DP rank's rollouts at one step."""
    return train_seed * 1_000_003 + step * 1009 + dp_rank


def payload_seeds(seed: int, n: int) -> list[int]:
    """The ``sampling_seed``s of one ``/generate`` call of ``n`` prompts whose sampling seed is ``seed``."""
    payload = build_generate_payload([[1, 2]] * n, SamplingParams(seed=seed), vocab_size=8, padded_vocab_size=8,
                                     send_seed=True)
    return [sp["sampling_seed"] for sp in payload["sampling_params"]]


@pytest.mark.parametrize("train_seed", [0, 1234, 2148, 4242, 12345, 31337, 2**31 - 1])
def test_request_seeds_fit_sglangs_int32_for_every_accepted_train_seed(train_seed):
    calls = [loop_seed(train_seed, step, rank) for step in (1, 500, 10_000) for rank in (0, 7)]
    seeds = [s for seed in calls for s in payload_seeds(seed, 64)]
    assert all(isinstance(s, int) and 0 <= s < SEED_LIMIT == 2**31 for s in seeds)
    torch.tensor(seeds, dtype=torch.int32)  # how SGLang's SamplingBatchInfo holds them: no overflow
    for extreme in (0, 2**63 - 1):
        assert all(0 <= s < 2**31 for s in payload_seeds(extreme, 8))


def test_dp_ranks_and_steps_never_share_a_seed():
    """8 DP ranks x 128 requests at one step, and two consecutive steps of 2048 requests on one rank: every
    request has its own seed (with ``base + rank + i`` nearly every seed was used by up to 8 ranks)."""
    base = loop_seed(1234, 1, 0)
    per_rank = [payload_seeds(base + rank, 128) for rank in range(8)]
    flat = [s for seeds in per_rank for s in seeds]
    assert len(set(flat)) == len(flat) == 8 * 128
    step1, step2 = request_seeds(loop_seed(1234, 1, 0), 2048), request_seeds(loop_seed(1234, 2, 0), 2048)
    assert not set(step1) & set(step2)


def test_seeds_are_reproducible_and_distinct_within_a_call():
    assert payload_seeds(77, 5) == payload_seeds(77, 5) == request_seeds(77, 5)
    assert request_seeds(77, 3) == request_seeds(77, 5)[:3]  # a longer call extends the shorter one's seeds
    # 10^5 draws of 31 bits repeat a value about twice on average (4 times from seed 5): the repeats are replaced
    many = request_seeds(5, 100_000)
    assert len(set(many)) == len(many)
    low_bits = sum(s & 1 for s in many) / len(many)
    assert abs(low_bits - 0.5) < 0.01  # well mixed, not consecutive integers
    with pytest.raises(ValueError, match="sampling.seed"):
        request_seeds(-1, 2)


@pytest.mark.parametrize("bad", [-1, 2**31, 2**62, True, 1.5, "7"])
def test_train_seed_outside_int31_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"train\.seed=.*\[0, 2\*\*31\).*train\.seed=1234"):
        TrainConfig(seed=bad)


def test_train_seed_is_checked_where_the_config_is_parsed():
    from megatron_logra.config import parse_args_to_config

    for good in (0, 2**31 - 1):
        assert TrainConfig(seed=good).seed == good
        # the largest accepted train.seed still gives SamplingParams seeds the loop can use
        SamplingParams(seed=loop_seed(good, 10**6, 1023))
    with pytest.raises(ValueError, match=r"train\.seed=-1"):
        parse_args_to_config("tiny", ["train.seed=-1"])
    with pytest.raises(ValueError, match=r"train\.seed=4611686018427387904"):
        parse_args_to_config("tiny", [f"--seed={2**62}"])

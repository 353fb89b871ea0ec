"""``rl.advantage.normalize`` under data parallelism (2 gloo ranks, no model): ``rl.advantages.whiten_advantages``
whitens each rank's advantages with the statistics of every rank's loss tokens (one all-reduce), so DP = 2 gives
exactly what one process gives on the concatenated global batch, and both ranks log the same pre-whitening std.
Advantages are multiples of 1/8 and the token counts small, so every float64 sum is exact and the comparison of
the dyadic cases is bitwise."""

from __future__ import annotations

import json
import os

import pytest
import torch

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed

# case -> rank -> (advantages, completion tokens); the shards' means and lengths differ, so per-rank statistics
# would give other values
CASES = {
    "dyadic": [([1.0, -0.5, 0.25, 0.0], [3, 7, 1, 4]), ([0.875, -1.0, 0.0, 0.5], [12, 2, 5, 0])],
    "one_rank_without_tokens": [([0.5, -0.25], [0, 0]), ([1.0, -1.0, 0.125], [2, 6, 3])],
    "all_equal": [([0.375, 0.375], [4, 9]), ([0.375, 0.375, 0.375], [1, 1, 30])],
}


def _random_case() -> list[tuple[list[float], list[int]]]:
    g = torch.Generator().manual_seed(7)
    return [((torch.randn(6, generator=g) * 2).tolist(), torch.randint(0, 20, (6,), generator=g).tolist())
            for _ in range(2)]


def _worker(rank: int, world: int, result_dir: str) -> None:
    import torch.distributed as dist

    from megatron_logra.rl.advantages import whiten_advantages

    out = {}
    for name, shards in {**CASES, "random": _random_case()}.items():
        values, counts = shards[rank]
        whitened, std = whiten_advantages(torch.tensor(values, dtype=torch.float32), counts, dist.group.WORLD)
        out[name] = {"whitened": whitened.tolist(), "std": std}
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("advwhiten_dp")
    spawn_group(_worker, 2, out, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _one_process(shards) -> tuple[list[float], float]:
    from megatron_logra.rl.advantages import whiten_advantages

    values = torch.tensor([v for vs, _ in shards for v in vs], dtype=torch.float32)
    counts = [n for _, ns in shards for n in ns]
    whitened, std = whiten_advantages(values, counts, None)
    return whitened.tolist(), std


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_dp_ranks_whiten_exactly_as_one_process(two_ranks, name):
    want, want_std = _one_process(CASES[name])
    split = len(CASES[name][0][0])
    assert two_ranks[0][name]["whitened"] + two_ranks[1][name]["whitened"] == want
    assert two_ranks[0][name]["std"] == two_ranks[1][name]["std"] == want_std
    assert len(two_ranks[0][name]["whitened"]) == split
    if name == "all_equal":
        assert want == [0.0] * len(want) and want_std == 0.0
    elif name == "dyadic":  # the statistics are the global batch's, not a shard's
        assert two_ranks[1][name]["whitened"] != _one_process(CASES[name][1:])[0]
    else:  # a rank without loss tokens still whitens, by its peer's tokens (alone it would keep its values)
        assert two_ranks[0][name]["whitened"] != CASES[name][0][0] == _one_process(CASES[name][:1])[0]


def test_random_advantages_agree_with_one_process(two_ranks):
    want, want_std = _one_process(_random_case())
    assert two_ranks[0]["random"]["whitened"] + two_ranks[1]["random"]["whitened"] == pytest.approx(want, rel=1e-6)
    assert two_ranks[0]["random"]["std"] == two_ranks[1]["random"]["std"] == pytest.approx(want_std, rel=1e-12)

"""A reasoning-gym name misspelt with capitals, hyphens or blanks (``Chain_Sum``, ``chain-sum``, ``Basic Arithmetic``)
is refused by the name check before the dataset lookup that suggests close names ever ran, so it got no suggestion
while ``chainsum`` got one; it now names the registered dataset it most likely means."""

from __future__ import annotations

import pytest
from reasoning_gym.factory import DATASETS

from megatron_logra.rewards import TaskConfig


@pytest.mark.parametrize("spelt, meant", [("Chain_Sum", "chain_sum"), ("chain-sum", "chain_sum"), ("GCD", "gcd"),
                                          ("Basic Arithmetic", "basic_arithmetic")])
@pytest.mark.parametrize("field", ["datasets", "eval_datasets"])
def test_a_misspelt_name_suggests_the_registered_one(spelt, meant, field):
    assert meant in DATASETS and spelt not in DATASETS
    kwargs = {"datasets": ["gcd"], field: [spelt]} if field == "eval_datasets" else {field: [spelt]}
    with pytest.raises(ValueError, match=rf"task\.{field}\[0\]='{spelt}'.*did you mean {meant}\b"):
        TaskConfig(**kwargs)


def test_a_name_like_no_dataset_suggests_nothing():
    with pytest.raises(ValueError, match=r"expected a reasoning-gym name") as exc:
        TaskConfig(datasets=["foo/bar"])
    assert "did you mean" not in str(exc.value)

"""A recipe file that sets one field twice under two spellings is refused naming the field (only the last value
would count), as a YAML key repeated in one mapping is."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config


@pytest.mark.parametrize("body, field", [
    ("train: {steps: 5}\ntrain.steps: 6\n", "train.steps"),
    ("logra: {rank: 8}\noptimizer: {logra: {rank: 4}}\n", "optimizer.logra.rank"),
    ("logra.rank: 8\noptimizer.logra.rank: 4\n", "optimizer.logra.rank"),
    ("num-layers: 2\nmodel: {num_layers: 2}\n", "model.num_layers"),
])
def test_one_field_spelled_twice_is_refused(tmp_path, body, field):
    path = tmp_path / "r.yaml"
    path.write_text("recipe: lm-tiny\n" + body)
    with pytest.raises(ValueError, match=rf"recipe file .*r\.yaml: {field} is set twice"):
        parse_args_to_config(str(path), [])


def test_distinct_fields_of_one_section_in_two_spellings_pass(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("recipe: lm-tiny\ntrain: {steps: 5}\ntrain.log_interval: 2\nlogra: {rank: 8}\n"
                    "optimizer: {logra: {lr: 0.01}}\n")
    cfg = parse_args_to_config(str(path), [])
    assert (cfg.train.steps, cfg.train.log_interval, cfg.optimizer.logra.rank, cfg.optimizer.logra.lr) == (5, 2, 8, 0.01)

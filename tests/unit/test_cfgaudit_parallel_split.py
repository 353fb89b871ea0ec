"""A TP / PP layout that megatron-core cannot build (it asserts at model build, after the process groups are up)
is refused by config validation: ``parallel.pp`` must divide ``model.num_layers``, ``parallel.tp`` the heads,
query groups and ``model.ffn_hidden_size``."""

from __future__ import annotations

import pytest

from megatron_logra.cli import main
from megatron_logra.config import parse_args_to_config


@pytest.mark.parametrize("recipe, overrides, message", [
    ("tiny", ["parallel.pp=3"], "parallel.pp=3 must divide model.num_layers=4: choose parallel.pp in [1, 2, 4]"),
    ("lm-tiny", ["parallel.pp=2", "model.num_layers=3"],
     "parallel.pp=2 must divide model.num_layers=3: choose parallel.pp in [1, 3]"),
    ("lm-tiny", ["parallel.tp=2", "model.ffn_hidden_size=191"],
     "parallel.tp=2 must divide model.ffn_hidden_size=191: choose parallel.tp in [1]"),
    ("lm-tiny", ["parallel.tp=4", "model.num_query_groups=2"],
     "parallel.tp=4 must divide model.num_query_groups=2: choose parallel.tp in [1, 2]"),
])
def test_an_uneven_split_is_refused_naming_the_fields(recipe, overrides, message):
    with pytest.raises(ValueError) as info:
        parse_args_to_config(recipe, overrides)
    assert message in str(info.value)


def test_even_splits_pass():
    cfg = parse_args_to_config("lm-tiny", ["parallel.pp=2", "parallel.tp=2"])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)


def test_cli_exits_2_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", "tiny", "parallel.pp=3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "parallel.pp=3 must divide model.num_layers=4" in err and "Traceback" not in err

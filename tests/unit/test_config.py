"""Config validation, overrides, Megatron-LM aliases and recipes."""

from __future__ import annotations

import pytest

from megatron_logra.config import RunConfig, to_dict, from_dict, load_recipe, parse_args_to_config
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.optim.config import LograConfig, NativeConfig, OptimizerConfig
from megatron_logra.parallel import ParallelConfig


def test_megatron_aliases_and_flags_map_to_fields():
    cfg = parse_args_to_config("lm-tiny", [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=2", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--seq-length", "48", "--num-layers", "4", "--bf16", "--lr", "0.01",
        "--train-iters", "7", "--recompute-granularity", "full",
    ])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.steps) == (4, 16, 7)
    assert cfg.model.seq_length == 48 and cfg.model.num_layers == 4
    assert cfg.model.params_dtype == "bfloat16" and cfg.model.recompute == "full"
    assert cfg.optimizer.logra.lr == pytest.approx(0.01)


def test_dotted_overrides_and_shortcuts_parse_types():
    cfg = parse_args_to_config(None, [
        "optimizer.logra.rank=8", "--logra.distribution", "gaussian", "logra.refresh=false",
        "native.freeze=true", "logra.targets=linear_qkv,linear_fc2", "model.num_query_groups=2",
    ])
    assert cfg.optimizer.logra.rank == 8
    assert cfg.optimizer.logra.distribution == "gaussian"
    assert cfg.optimizer.logra.refresh is False
    assert cfg.optimizer.native.freeze is True
    assert cfg.optimizer.logra.targets == ["linear_qkv", "linear_fc2"]
    assert cfg.model.num_query_groups == 2
    assert parse_args_to_config(None, ["model.num_query_groups=none"]).model.num_query_groups is None


@pytest.mark.parametrize("override, field", [
    ("logra.rank=0", "logra.rank"),
    ("logra.distribution=uniform", "logra.distribution"),
    ("logra.beta2=1.0", "logra.beta2"),
    ("logra.recipe=magic", "logra.recipe"),
    ("logra.masters=fp8", "logra.masters"),
    ("parallel.tp=0", "parallel.tp"),
    ("model.hidden_size=30", "model.hidden_size"),
    ("train.global_batch_size=33", "train.global_batch_size"),
    ("optimizer.name=sgd", "optimizer.name"),
    ("model.seq_length=4", "model.seq_length"),
])
def test_bad_values_raise_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_args_to_config("lm-tiny", [override])


def test_unknown_keys_and_bad_types_are_rejected():
    with pytest.raises(ValueError, match="no field 'rnak'"):
        parse_args_to_config(None, ["logra.rnak=4"])
    with pytest.raises(ValueError, match="not an integer"):
        parse_args_to_config(None, ["logra.rank=four"])
    with pytest.raises(ValueError, match="not a boolean"):
        parse_args_to_config(None, ["logra.refresh=maybe"])
    with pytest.raises(ValueError, match="needs a value"):
        parse_args_to_config(None, ["--micro-batch-size"])
    with pytest.raises(ValueError, match="unknown recipe"):
        load_recipe("nope")


def test_component_configs_validate_on_construction():
    with pytest.raises(ValueError, match="logra.rank"):
        LograConfig(rank=-1)
    with pytest.raises(ValueError, match="native.beta1"):
        NativeConfig(beta1=1.0)
    with pytest.raises(ValueError, match="parallel.pp"):
        ParallelConfig(pp=0)
    with pytest.raises(ValueError, match="num_query_groups"):
        ModelConfig(num_attention_heads=4, num_query_groups=3)
    with pytest.raises(ValueError, match="optimizer.name"):
        OptimizerConfig(name="lion")


def test_yaml_recipe_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: lm-tiny\noptimizer:\n  logra:\n    rank: 4\n    targets: [linear_qkv]\ntrain:\n  steps: 3\n")
    cfg = load_recipe(str(path))
    assert cfg.optimizer.logra.rank == 4 and cfg.optimizer.logra.targets == ["linear_qkv"] and cfg.train.steps == 3
    assert cfg.model.hidden_size == load_recipe("lm-tiny").model.hidden_size
    rebuilt = from_dict(RunConfig, to_dict(cfg))
    assert to_dict(rebuilt) == to_dict(cfg)
    with pytest.raises(ValueError, match="unknown RunConfig fields"):
        from_dict(RunConfig, {"modle": {}})


def test_rl_sections_parse_lists_and_json():
    cfg = parse_args_to_config("tiny", [
        "task.datasets=chain_sum,gcd", "task.weights=0.25,0.75", "--rl.group_size", "4",
        'task.dataset_kwargs={"gcd": {"min_value": 1, "max_value": 20}}', "kl.mode=none", "native.freeze=false",
        "--optimizer", "adam",  # dense AdamW reads neither kl.mode nor native.freeze: both must be off
    ])
    assert cfg.task.datasets == ["chain_sum", "gcd"] and cfg.task.weights == [0.25, 0.75]
    assert cfg.rl.group_size == 4 and cfg.kl.mode == "none" and cfg.optimizer.name == "adam"
    assert cfg.task.dataset_kwargs == {"gcd": {"min_value": 1, "max_value": 20}}
    flow = parse_args_to_config("tiny", ["task.datasets=[chain_sum, 'gcd']", "task.weights=[0.5,0.5]"])
    assert flow.task.datasets == ["chain_sum", "gcd"] and flow.task.weights == [0.5, 0.5]
    with pytest.raises(ValueError, match="rl.group_size"):
        parse_args_to_config("tiny", ["rl.group_size=0"])
    with pytest.raises(ValueError, match="kl.mode"):
        parse_args_to_config("tiny", ["kl.mode=magic"])
    with pytest.raises(ValueError, match="job"):
        parse_args_to_config("tiny", ["job=pretrain"])

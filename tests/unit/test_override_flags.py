"""Megatron-LM launch lines on the command line: well-known switches are mapped or accepted (with a warning
saying why), unknown flags are refused naming the closest spelling without taking the next argument, common
flags reach their fields (``--position-embedding-type``, ``--load``), one field given twice under two spellings
with different values is refused naming both, and a LoGRA rank above a target's input width names
``optimizer.logra.rank``."""

from __future__ import annotations

import logging

import pytest
import yaml
from torch import nn

from megatron_logra.cli import main
from megatron_logra.megatron_flags import IGNORED_SWITCHES, known_flags
from megatron_logra.config import parse_args_to_config

# ---------------------------------------------------------------------------- switches and unknown flags


@pytest.mark.parametrize("switch", ["use-distributed-optimizer", "use-mcore-models", "group-query-attention",
                                    "use-flash-attn", "no-masked-softmax-fusion", "overlap-grad-reduce"])
def test_a_known_megatron_switch_is_accepted_with_a_warning_and_takes_no_value(switch, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.config.args"):
        cfg = parse_args_to_config("tiny", [f"--{switch}", "--tensor-model-parallel-size", "2", "--seed", "7"])
    assert cfg.parallel.tp == 2 and cfg.train.seed == 7  # the next flag is not swallowed as the switch's value
    (record,) = [r for r in caplog.records if f"--{switch}" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "accepted and ignored" in record.getMessage()
    assert IGNORED_SWITCHES[switch] in record.getMessage()  # says why


def test_group_query_attention_with_num_query_groups_sets_the_groups():
    cfg = parse_args_to_config("tiny", ["--group-query-attention", "--num-query-groups", "2"])
    assert cfg.model.num_query_groups == 2


def test_switches_with_a_field_set_it():
    cfg = parse_args_to_config("tiny", ["--bf16", "--transformer-impl", "auto", "--sequence-parallel",
                                        "--disable-bias-linear",
                                        "--untie-embeddings-and-output-weights", "--swiglu",
                                        "--use-rotary-position-embeddings"])
    m = cfg.model
    assert (m.params_dtype, m.sequence_parallel, m.add_bias_linear) == ("bfloat16", True, False)
    assert (m.untie_embeddings_and_output_weights, m.swiglu, m.position_embedding_type) == (True, True, "rope")


@pytest.mark.parametrize("args, match", [
    (["--seq-lenght", "64"], r"unknown option --seq-lenght: .*did you mean --seq-length"),
    (["--tensor-parallel-size", "2"], r"unknown option --tensor-parallel-size: .*did you mean "
                                      r"--tensor-model-parallel-size"),
    (["--rotary-bas", "500000"], r"unknown option --rotary-bas: .*--rotary-base"),
])
def test_an_unknown_flag_is_refused_naming_the_closest_flag(args, match):
    with pytest.raises(ValueError, match=match):
        parse_args_to_config("tiny", args)


def test_an_unknown_switch_never_takes_the_next_flag_as_its_value():
    with pytest.raises(ValueError, match=r"unknown option --frobnicate-widgets") as info:
        parse_args_to_config("tiny", ["--frobnicate-widgets", "--tensor-model-parallel-size", "2"])
    assert "needs a value" not in str(info.value) and "cannot parse" not in str(info.value)


def test_a_value_flag_before_another_flag_needs_a_value_naming_both():
    with pytest.raises(ValueError, match=r"option --seq-length needs a value \(the next argument is the option "
                                         r"--bf16\)"):
        parse_args_to_config("tiny", ["--seq-length", "--bf16"])


def test_a_switch_given_a_value_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"--bf16 is a switch and takes no value: .*model\.params_dtype=VALUE"):
        parse_args_to_config("tiny", ["--bf16=true"])


@pytest.mark.parametrize("args, match", [
    (["--data-path", "/data/x"], r"--data-path is a Megatron-LM flag this trainer cannot honour: .*task\.datasets"),
    (["--tokenizer-type", "GPT2BPETokenizer"], r"--tokenizer-type .*tokenizer\.path"),
    (["--finetune"], r"--finetune .*model\.hf_path"),
    (["--context-parallel-size", "2"], r"--context-parallel-size=2: context parallelism is not supported"),
    (["--recompute-activations"], r"--recompute-activations .*--recompute-granularity full"),
])
def test_flags_this_trainer_cannot_honour_are_refused_with_what_to_use(args, match):
    with pytest.raises(ValueError, match=match):
        parse_args_to_config("tiny", args)


def test_a_neutral_value_of_an_unsupported_feature_is_accepted():
    cfg = parse_args_to_config("tiny", ["--context-parallel-size", "1", "--recompute-granularity", "full",
                                        "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    assert cfg.model.recompute == "full"


def test_every_flag_is_in_one_table():
    names = known_flags()
    assert len(names) == len(set(names))
    assert {"load", "position-embedding-type", "use-distributed-optimizer", "group-query-attention"} <= set(names)


# ---------------------------------------------------------------------------- flags that reach their fields
def test_position_embedding_type_sets_the_field():
    cfg = parse_args_to_config("tiny", ["--position-embedding-type", "learned_absolute"])
    assert cfg.model.position_embedding_type == "learned_absolute"
    assert parse_args_to_config("tiny", ["--position-embedding-type=rope"]).model.position_embedding_type == "rope"


def test_a_llama_style_launch_line_sets_its_fields():
    line = ("--tensor-model-parallel-size 2 --use-mcore-models --use-distributed-optimizer --bf16 "
            "--num-layers 2 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4 "
            "--group-query-attention --num-query-groups 2 --position-embedding-type rope --no-position-embedding "
            "--rotary-base 500000 --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
            "--disable-bias-linear --seq-length 64 --max-position-embeddings 64 --micro-batch-size 4 "
            "--global-batch-size 32 --train-iters 9 --lr 1e-3 --seed 11 --save runs/llama --load runs/llama "
            "job=lm")
    cfg = parse_args_to_config("lm-tiny", line.split())
    m, t = cfg.model, cfg.train
    assert (cfg.parallel.tp, m.params_dtype, m.num_query_groups, m.rotary_base) == (2, "bfloat16", 2, 500000)
    assert (m.hidden_size, m.ffn_hidden_size, m.seq_length, m.normalization) == (128, 256, 64, "RMSNorm")
    assert (t.micro_batch_size, t.global_batch_size, t.steps, t.seed) == (4, 32, 9, 11)
    assert cfg.optimizer.logra.lr == pytest.approx(1e-3)
    assert (t.run_dir, t.resume) == ("runs/llama", True)


def test_load_continues_the_run_in_its_directory():
    cfg = parse_args_to_config("tiny", ["--load", "runs/prev"])
    assert (cfg.train.run_dir, cfg.train.resume) == ("runs/prev", True)


def test_load_and_save_naming_other_directories_are_refused_pointing_at_resume():
    with pytest.raises(ValueError, match=r"train\.run_dir is set twice with different values, as --save runs/a "
                                         r"and as --load runs/b.*--resume DIR"):
        parse_args_to_config("tiny", ["--save", "runs/a", "--load", "runs/b"])


def test_no_position_embedding_is_refused_with_a_learned_position_table():
    with pytest.raises(ValueError, match=r"--no-position-embedding .*position_embedding_type=learned_absolute"):
        parse_args_to_config("tiny", ["--no-position-embedding", "--position-embedding-type", "learned_absolute"])


# ---------------------------------------------------------------------------- one field given twice
@pytest.mark.parametrize("args, field, first, second", [
    (["--tensor-model-parallel-size", "2", "parallel.tp=1"], "parallel.tp", "--tensor-model-parallel-size 2",
     "parallel.tp=1"),
    (["logra.rank=8", "optimizer.logra.rank=4"], "optimizer.logra.rank", "logra.rank=8", "optimizer.logra.rank=4"),
    (["--bf16", "model.params_dtype=float32"], "model.params_dtype", "--bf16 (bfloat16)",
     "model.params_dtype=float32"),
    (["--seq-length", "64", "--model.seq_length", "32"], "model.seq_length", "--seq-length 64",
     "--model.seq_length 32"),
])
def test_one_field_given_twice_with_different_values_is_refused_naming_both(args, field, first, second):
    with pytest.raises(ValueError) as info:
        parse_args_to_config("tiny", args)
    message = str(info.value)
    assert message.startswith(f"{field} is set twice with different values")
    assert f"as {first} and as {second}" in message


def test_a_context_flag_and_its_field_at_different_values_name_both():
    with pytest.raises(ValueError, match=r"--train-iters sets rl\.steps here, which is also given with another "
                                         r"value, as rl\.steps=7 and as --train-iters 5"):
        parse_args_to_config("tiny", ["--train-iters", "5", "rl.steps=7"])


def test_the_same_value_twice_is_fine():
    cfg = parse_args_to_config("tiny", ["--tensor-model-parallel-size", "2", "parallel.tp=2", "logra.rank=8",
                                        "optimizer.logra.rank=8", "--train-iters", "5", "rl.steps=5"])
    assert (cfg.parallel.tp, cfg.optimizer.logra.rank, cfg.rl.steps) == (2, 8, 5)


def test_the_same_key_repeated_takes_its_last_value():
    cfg = parse_args_to_config("tiny", ["rl.steps=5", "rl.steps=7", "--seed", "1", "--seed=2"])
    assert (cfg.rl.steps, cfg.train.seed) == (7, 2)


# ---------------------------------------------------------------------------- the LoGRA rank
def test_a_rank_above_a_targets_input_width_names_the_dotted_field():
    with pytest.raises(ValueError, match=r"optimizer\.logra\.rank=1000 exceeds the input width 128 "
                                         r"\(model\.hidden_size\) of the LoGRA target .*optimizer\.logra\.rank <= 128"):
        parse_args_to_config("tiny", ["logra.rank=1000"])
    assert parse_args_to_config("tiny", ["logra.rank=128"]).optimizer.logra.rank == 128


def test_installing_sketches_of_too_high_a_rank_names_the_dotted_field():
    from megatron_logra.sketch.capture import install_sketches

    model = nn.Module()
    model.linear_fc2 = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"rank=16 exceeds n_in=8 of target linear_fc2; choose "
                                         r"optimizer\.logra\.rank <= 8"):
        install_sketches(model, ["linear_fc2"], rank=16)


# ---------------------------------------------------------------------------- through the CLI
def test_cli_config_takes_a_megatron_launch_line(capsys):
    assert main(["config", "tiny", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
                 "--position-embedding-type", "rope", "--bf16"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["parallel"]["tp"] == 2 and out["model"]["params_dtype"] == "bfloat16"


@pytest.mark.parametrize("args, expected", [
    (["--frobnicate", "3"], "unknown option --frobnicate"),
    (["--tensor-model-parallel-size", "2", "parallel.tp=1"], "parallel.tp is set twice"),
    (["logra.rank=1000"], "optimizer.logra.rank=1000 exceeds"),
])
def test_cli_config_reports_the_errors_with_exit_status_2(args, expected, capsys):
    with pytest.raises(SystemExit) as info:
        main(["config", "tiny", *args])
    assert info.value.code == 2
    assert expected in capsys.readouterr().err

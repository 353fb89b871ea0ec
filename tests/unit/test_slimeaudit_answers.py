"""The answers given to slime's flags that were unknown options before: the new aliases and value maps set their
fields, one-value flags refuse other values with why, refused flags say they are slime's and name what to use (a
refused flag's several words do not break the rest of the line), flags without effect are kept with a logged
reason, and a comma-joined ``--rollout-stop-token-ids`` names both spellings that work."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config


def test_log_probs_chunk_size_sets_the_chunk_and_slimes_minus_one_is_no_chunks():
    assert parse_args_to_config("tiny", ["--log-probs-chunk-size", "256"]).rl.loss.logprob_chunk_tokens == 256
    assert parse_args_to_config("tiny", ["--log-probs-chunk-size", "-1"]).rl.loss.logprob_chunk_tokens == 0
    for bad in ("-2", "x"):
        with pytest.raises(ValueError, match=r"--log-probs-chunk-size .*a whole number > 0, or -1"):
            parse_args_to_config("tiny", ["--log-probs-chunk-size", bad])


def test_wandb_dir_sets_the_wandb_save_dir(tmp_path):
    cfg = parse_args_to_config("tiny", ["--wandb-project", "p", "--wandb-dir", str(tmp_path)])
    assert cfg.train.wandb_save_dir == str(tmp_path)


def test_eval_top_k_is_accepted_off_and_top_k_one_names_greedy_evaluation():
    assert parse_args_to_config("tiny", ["--eval-top-k", "-1", "--rollout-top-k", "-1"]).rl.rollout.top_p == 1.0
    with pytest.raises(ValueError, match=r"--eval-top-k=1: .*--eval-temperature 0 \(rl\.rollout\.eval_temperature=0\)"):
        parse_args_to_config("tiny", ["--eval-top-k", "1"])
    with pytest.raises(ValueError, match=r"--rollout-top-k=20: top-k sampling is not supported"):
        parse_args_to_config("tiny", ["--rollout-top-k", "20"])


@pytest.mark.parametrize("flag,value,why", [
    ("flush-cache-interval", "2", "PipelineRL"),
    ("pg-loss-type", "reinforce", "score-centering"),
    ("start-rollout-id", "5", "--resume RUN_DIR"),
    ("num-critic-only-steps", "3", "no value critic"),
    ("metadata-key", "meta", '"metadata" object'),
])
def test_one_value_flags_refuse_other_values_with_why(flag, value, why):
    with pytest.raises(ValueError, match=rf"--{flag}={value}: .*{why}.*drop --{flag}"):
        parse_args_to_config("tiny", [f"--{flag}", value])


def test_refused_flags_name_what_to_use_and_their_words_are_skipped():
    line = ["--only-train-params-name-list", "experts", "layers", "--num-epoch", "3", "--use-opd",
            "--eval-input-key", "question", "--rollout-batch-size", "4"]
    with pytest.raises(ValueError) as err:
        parse_args_to_config("tiny", line)
    text = str(err.value)
    assert text.startswith("4 of the command line's options cannot be used")  # the words after them are values
    assert "--only-train-params-name-list is a slime flag this trainer cannot honour: " in text
    assert "optimizer.logra.targets" in text and "optimizer.native.freeze" in text
    assert "--num-rollout N (rl.steps)" in text and "on-policy distillation is not supported" in text
    assert "task.jsonl_prompt_key" in text and "cannot parse" not in text


@pytest.mark.parametrize("words,why", [
    (["--skip-eval-before-train"], "evaluation before the first step"),
    (["--use-tensorboard"], "RUN/tensorboard"),
    (["--rollout-skip-special-tokens"], "without special tokens"),
    (["--get-mismatch-metrics"], "mismatch"),
    (["--update-weight-transport", "disk"], "sync.mode"),
    (["--rollout-health-check-timeout", "30"], "health checks"),
    (["--opsm-delta", "1e-4"], "--use-opsm, which this trainer refuses"),
    (["--gamma", "0.99"], "no value critic" if False else "discounted returns"),
])
def test_flags_without_effect_are_kept_with_a_logged_reason(words, why, caplog):
    base = parse_args_to_config("tiny", [])
    with caplog.at_level(logging.WARNING):
        cfg = parse_args_to_config("tiny", words)
    assert cfg == base  # nothing the run reads changes
    warned = [r.getMessage() for r in caplog.records if "is accepted and ignored" in r.getMessage()]
    assert len(warned) == 1 and words[0] in warned[0] and why in warned[0]


def test_slimes_single_gpu_script_flags_are_kept():
    """The flags of slime's scripts/run-qwen3-0.6B-single-gpu.sh that were unknown options before."""
    cfg = parse_args_to_config("tiny", ["--skip-eval-before-train", "--eval-top-k", "-1", "--eval-max-response-len",
                                        "16", "--rollout-top-p", "0.95"])
    assert (cfg.rl.rollout.eval_max_new_tokens, cfg.rl.rollout.top_p) == (16, 0.95)


def test_comma_joined_stop_token_ids_name_both_spellings():
    with pytest.raises(ValueError, match=r"'5,6' is not an integer: .*give --rollout-stop-token-ids 5 6 "
                                         r"\(or --rollout-stop-token-ids=5,6\)"):
        parse_args_to_config("tiny", ["--rollout-stop-token-ids", "5,6"])
    assert parse_args_to_config("tiny", ["--rollout-stop-token-ids", "5", "6"]).rl.rollout.stop_token_ids == [5, 6]
    assert parse_args_to_config("tiny", ["--rollout-stop-token-ids=5,6"]).rl.rollout.stop_token_ids == [5, 6]
    assert parse_args_to_config("tiny", ["--rollout-stop", "a,b"]).rl.rollout.stop == ["a,b"]  # strings keep commas

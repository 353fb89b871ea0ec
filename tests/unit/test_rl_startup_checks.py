"""What the RL job refuses at start-up, before a model is built."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config


def test_prompts_that_cannot_fit_are_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """The prompts are tokenized at start-up: a generated source none of whose prompts leaves room for
    ``rl.rollout.max_new_tokens`` fails there (over-long ones are otherwise skipped, from the held-out set too),
    not at the first evaluation after the warm start."""
    from megatron_logra.data.tokenizer import build_tokenizer
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rewards import build_task
    from megatron_logra.rl import components, job
    from megatron_logra.rl.loop import rl_prompt_ids

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "model.seq_length=12",
                                        "task.num_eval=4"])
    # the longest held-out prompt, tokenized independently of the job, must exceed the room
    task = build_task(cfg.task)
    tok = build_tokenizer(cfg.tokenizer, [])
    longest = max(len(rl_prompt_ids(tok, cfg.rl, p.prompt)) for p in task.eval_problems())
    room = cfg.model.seq_length + 1 - cfg.rl.rollout.max_new_tokens
    assert longest > room

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the prompts were checked")

    monkeypatch.setattr(components, "build_gpt", no_model)
    destroy_parallel()
    try:
        with pytest.raises(ValueError, match=rf"'chain_sum' has no training prompts that fit: .* a prompt of \d+ "
                                             rf"tokens does not fit the {room} tokens of room \(model.seq_length=12"):
            job.run_rl(cfg)
    finally:
        destroy_parallel()


def test_a_float32_in_process_sglang_engine_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """SGLang's kernels run float16 / bfloat16 only: the run stops before the process group, the
    model or the run directory exist (it failed when the engine started, after the warm start)."""
    from megatron_logra.rl import components, job

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "rl.rollout.engine=sglang"])
    assert cfg.model.params_dtype == "float32"

    def no_group(*args, **kwargs):
        raise AssertionError("the process group was started before the engine dtype was checked")

    monkeypatch.setattr(components, "initialize_parallel", no_group)
    with pytest.raises(ValueError, match="model.params_dtype='float32'.*set model.params_dtype=bfloat16"):
        job.run_rl(cfg)
    assert not (tmp_path / "run").exists()


def test_a_warm_start_made_for_another_model_names_sft_init_path_and_the_fix(tmp_path):
    """The shipped warm start fits the tiny recipe's model (4 key/value heads); with GQA its QKV
    weight cannot load, and the error says which setting points at it and what to do."""
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "model.num_query_groups=2",
                                        "task.num_eval=4"])
    assert cfg.sft.init_path
    destroy_parallel()
    try:
        with pytest.raises(ValueError) as err:
            build_components(cfg)
    finally:
        destroy_parallel()
    msg = str(err.value)
    assert msg.startswith(f"sft.init_path={cfg.sft.init_path!r} does not load into this model")
    assert "linear_qkv.weight" in msg and "set sft.init_path= (empty)" in msg


def test_an_in_process_sglang_engine_without_sglang_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """``rl.rollout.engine=sglang`` (the large recipes) where SGLang cannot be imported: a user error naming
    the ways on, before the process group and the model (it was an ImportError traceback once a 1.5B model had
    been built)."""
    import sys

    from megatron_logra.rl import components, job

    monkeypatch.setitem(sys.modules, "sglang", None)  # not importable, whether or not it is installed
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "rl.rollout.engine=sglang",
                                        "model.params_dtype=bfloat16"])

    def no_group(*args, **kwargs):
        raise AssertionError("the process group was started before SGLang was looked for")

    monkeypatch.setattr(components, "initialize_parallel", no_group)
    with pytest.raises(ValueError, match=r"rl.rollout.engine='sglang' needs SGLang.*rl.rollout.sglang_url.*"
                                         r"rl.rollout.engine=embedded"):
        job.run_rl(cfg)
    assert not (tmp_path / "run").exists()

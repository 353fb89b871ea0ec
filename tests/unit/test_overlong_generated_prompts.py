"""A generated (reasoning-gym) source whose prompts are sometimes longer than ``model.seq_length`` leaves
for ``rl.rollout.max_new_tokens``: the train stream skips those prompts (deterministically, one warning per
source) instead of failing the run at the RL step that draws one; a source whose prompts never fit is
refused at start."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config

# chain_sum with 2..6 one-digit terms: prompts of 20, 24, 28, 32 and 36 tokens with the tiny recipe's tokenizer
LONGER = '{"chain_sum": {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 1}}'
N = 200


def _cfg(tmp_path, seq_length: int):
    return parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"model.seq_length={seq_length}",
                                         "task.num_eval=0", f"task.dataset_kwargs={LONGER}"])


def _filtered_task(cfg, tmp_path):
    from megatron_logra.rl.components import _task_and_tokenizer

    task, tok, _ = _task_and_tokenizer(cfg, tmp_path / "run", will_save=False)
    return task, tok


def test_over_long_generated_prompts_are_skipped_deterministically(tmp_path, caplog):
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.loop import prompt_room, rl_prompt_ids

    cfg = _cfg(tmp_path, 30)
    room = prompt_room(cfg)
    assert room == 30 + 1 - cfg.rl.rollout.max_new_tokens
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.task"):
        task, tok = _filtered_task(cfg, tmp_path)
        filtered = [task.train_problem(i) for i in range(N)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
    other, _ = _filtered_task(cfg, tmp_path)  # another instance (another DP rank): the same problems (its own warning)
    unfiltered = [build_task(cfg.task).train_problem(i) for i in range(N)]

    def length(prompt: str) -> int:
        return len(rl_prompt_ids(tok, cfg.rl, prompt))

    assert all(length(p.prompt) <= room for p in filtered)
    assert [(p.prompt, p.answer) for p in filtered] == [(other.train_problem(i).prompt, other.train_problem(i).answer)
                                                        for i in range(N)]
    long = [i for i, p in enumerate(unfiltered) if length(p.prompt) > room]
    assert 0 < len(long) < N  # the config exercises both cases
    for i, (kept, plain) in enumerate(zip(filtered, unfiltered)):
        if i in long:
            assert kept.prompt != plain.prompt
        else:
            assert (kept.prompt, kept.answer) == (plain.prompt, plain.answer)
    assert not any(task.is_eval_prompt(p.prompt) for p in filtered)
    assert task.overlong_skips["chain_sum"] >= len(long)

    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert message.startswith("chain_sum: a prompt of ")
    assert f"does not fit the {room} tokens of room" in message
    assert "raise model.seq_length or lower rl.rollout.max_new_tokens" in message


def test_a_generated_source_whose_prompts_never_fit_is_refused_at_start(tmp_path):
    from megatron_logra.rl.components import build_components, check_config

    cfg = _cfg(tmp_path, 18)  # room 13: the shortest prompt has 20 tokens
    with pytest.raises(ValueError) as err:
        check_config(cfg)
    message = str(err.value)
    assert "'chain_sum' has no training prompts that fit" in message
    assert "over-long" in message and "does not fit the 13 tokens of room" in message
    for field in ("model.seq_length", "rl.rollout.max_new_tokens", "task.dataset_kwargs['chain_sum']"):
        assert field in message, message
    # the job refuses it the same way, before any model is built
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl import components

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the prompts were checked")

    destroy_parallel()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(components, "build_gpt", no_model)
            with pytest.raises(ValueError, match="'chain_sum' has no training prompts that fit"):
                build_components(_cfg(tmp_path, 18))
    finally:
        destroy_parallel()


def test_the_held_out_set_skips_over_long_prompts_too(tmp_path, caplog):
    """The held-out set of a generated source holds only prompts that fit (one warning), and the same ones
    as without the filter wherever those fit, in the same order; before, one over-long held-out prompt refused
    the run."""
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.loop import prompt_room, rl_prompt_ids

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "model.seq_length=30",
                                        "task.num_eval=20", f"task.dataset_kwargs={LONGER}"])
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.task"):
        task, tok = _filtered_task(cfg, tmp_path)
        held_out = [p.prompt for p in task.eval_problems()]
    fits = lambda prompt: len(rl_prompt_ids(tok, cfg.rl, prompt)) <= prompt_room(cfg)  # noqa: E731
    assert len(held_out) == 20 and all(fits(p) for p in held_out)
    plain = [p.prompt for p in build_task(cfg.task).eval_problems()]
    assert any(not fits(p) for p in plain)  # the case this is about: some held-out prompts did not fit
    assert [p for p in plain if fits(p)] == held_out[:len([p for p in plain if fits(p)])]
    warned = [r.getMessage() for r in caplog.records if "held-out prompts that do not fit are skipped" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("chain_sum: a prompt of ")
    assert task.overlong_skips["chain_sum (held-out)"] >= 1


def test_over_long_jsonl_prompts_are_still_refused_at_start(tmp_path):
    """A file the user wrote is not filtered: its longest prompt that does not fit is refused, naming the fix."""
    import json

    from megatron_logra.rl.components import check_config

    rows = [{"prompt": "What is 2 + 2?", "answer": "4"},
            {"prompt": "What is " + " + ".join(["1"] * 30) + "?", "answer": "30"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "model.seq_length=30",
                                        f"task.datasets=jsonl:{path}", "task.num_eval=0"])
    with pytest.raises(ValueError, match=r"a prompt of \d+ tokens does not fit: model.seq_length=30"):
        check_config(cfg)


def test_a_filter_is_a_pure_function_of_the_prompt_and_none_restores_the_stream():
    """Task level: without a filter the stream is the eval-only-skipping one; a filter skips like eval-only."""
    from megatron_logra.rewards import TaskConfig, build_task

    kwargs = {"chain_sum": {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 1}}
    task = build_task(TaskConfig(datasets=["chain_sum"], dataset_kwargs=kwargs, num_eval=0))
    plain = [task.train_problem(i).prompt for i in range(50)]
    task.set_prompt_filter(lambda prompt: prompt.count("+") <= 2, lambda prompt: f"{prompt.count('+')} pluses")
    short = [task.train_problem(i).prompt for i in range(50)]
    assert all(p.count("+") <= 2 for p in short)
    assert [s for s, p in zip(short, plain) if p.count("+") <= 2] == [p for p in plain if p.count("+") <= 2]
    task.set_prompt_filter(lambda prompt: False, lambda prompt: "never")
    with pytest.raises(ValueError, match="'chain_sum' has no training prompts that fit.*the last one: never"):
        task.check_trainable()
    task.set_prompt_filter(None)
    assert [task.train_problem(i).prompt for i in range(50)] == plain



def test_a_held_out_set_emptied_by_the_filter_names_the_sequence_length_not_eval_modulus(tmp_path, caplog):
    """When every held-out prompt is too long, the warnings name model.seq_length and max_new_tokens (the fix),
    not task.eval_modulus (the held-out share is not what is short)."""
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.evaluation import no_held_out_reason
    from megatron_logra.rl.loop import prompt_room, rl_prompt_ids

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "model.seq_length=30",
                                        "task.num_eval=4", f"task.dataset_kwargs={LONGER}"])
    task, tok = _filtered_task(cfg, tmp_path)
    # the tokenizer's real length check, with held-out prompts refused (as if all were over-long)
    task.set_prompt_filter(lambda prompt: not task.is_eval_prompt(prompt)
                           and len(rl_prompt_ids(tok, cfg.rl, prompt)) <= prompt_room(cfg),
                           lambda prompt: "too long")
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.eval_set"):
        assert task.eval_problems() == []
    (warned,) = [r.getMessage() for r in caplog.records if "eval-only prompts found" in r.getMessage()]
    assert "do not fit the sequence" in warned and "model.seq_length" in warned, warned
    assert "eval_modulus" not in warned, warned
    level, why = no_held_out_reason(cfg, task)
    assert level == logging.WARNING and "model.seq_length=30" in why and "eval_modulus" not in why, why
    # without any refused prompt the reason is the data's held-out share, and num_eval=0 is no warning at all
    assert "task.eval_modulus" in no_held_out_reason(cfg, build_task(cfg.task))[1]
    cfg.task.num_eval = 0
    assert no_held_out_reason(cfg, task) == (logging.INFO, "task.num_eval=0")

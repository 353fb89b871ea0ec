"""The length rule of held-out prompts under ``rl.rollout.eval_max_new_tokens``: a held-out prompt must leave room
for the evaluation's cap within ``model.seq_length`` (a training prompt for ``rl.rollout.max_new_tokens``), by the
rules a training prompt follows — a file's row that does not fit is refused naming ``PATH:LINE``, a generated
source's is skipped with one warning, a benchmark none of whose prompts fits is refused — and every message names
the evaluation's field where it applies. Without the field, everything is as before."""

from __future__ import annotations

import logging

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.rewards import prompt_bucket
from support.jsonl_rows import write_rows

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

# chain_sum with 2..6 one-digit terms: prompts of 20, 24, 28, 32 and 36 tokens with the tiny recipe's tokenizer
LONGER = '{"chain_sum": {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 1}}'
SHORT, LONG = "what is {} plus one", "what is {} plus one and one one one one one"  # 18 and 42 tokens
EVAL = "rl.rollout.eval_max_new_tokens"


def _cfg(tmp_path, *overrides: str):
    return parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", *overrides])


def _task(cfg, tmp_path):
    from megatron_logra.rl.components import _task_and_tokenizer

    return _task_and_tokenizer(cfg, tmp_path / "run", will_save=False)[:2]


def _first(template: str, held_out: bool) -> str:
    """The first prompt of ``template`` that the eval_modulus split holds out (``held_out``) or trains on."""
    return next(p for p in (template.format(i) for i in range(1000, 9999)) if (prompt_bucket(p, 16) == 0) == held_out)


def test_a_held_out_prompt_that_fits_training_but_not_the_evaluation_cap_is_refused_naming_it(tmp_path):
    """A file's held-out row (the eval_modulus split) is checked for the evaluation's cap and refused naming its line
    and the field; a long training row of the same file keeps the training cap; without the field, or without
    evaluation (``task.num_eval=0``), the same file is accepted."""
    from megatron_logra.rl.components import check_config
    from megatron_logra.rl.loop import prompt_room, rl_prompt_ids

    rows = [(SHORT.format(i), str(i + 1)) for i in range(30)]
    rows += [(_first(LONG, held_out=False), "1"), (_first(LONG, held_out=True), "1")]  # lines 31 and 32
    spec = write_rows(tmp_path / "rows.jsonl", rows)
    base = ["model.seq_length=64", "rl.rollout.max_new_tokens=6", f"task.datasets={spec}", "task.num_eval=4"]
    cfg = _cfg(tmp_path, *base)
    task, tok = _task(cfg, tmp_path)  # the training cap leaves room for every row
    longest = len(rl_prompt_ids(tok, cfg.rl, rows[-1][0]))
    assert prompt_room(cfg) >= longest > 64 + 1 - 30  # fits the training cap, not an evaluation cap of 30
    check_config(_cfg(tmp_path, *base[:-1], "task.num_eval=0", f"{EVAL}=30"))  # nothing evaluated: nothing refused
    with pytest.raises(ValueError) as info:
        check_config(_cfg(tmp_path, *base, f"{EVAL}=30"))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'rows.jsonl'}:32: a prompt of {longest} tokens does not fit"), message
    assert f"before {EVAL}=30" in message and f"lower {EVAL} to " in message and "model.seq_length to " in message
    held_out = sum(prompt_bucket(prompt, 16) == 0 for prompt, _ in rows)  # the long one and short ones
    assert f"(1 of the {held_out} held-out prompts of " in message and "rl.rollout.max_new_tokens" not in message


def test_a_benchmark_row_is_checked_for_the_evaluation_cap(tmp_path):
    from megatron_logra.rl.components import check_config

    train = write_rows(tmp_path / "train.jsonl", [(SHORT.format(i), str(i + 1)) for i in range(20)])
    bench = write_rows(tmp_path / "bench.jsonl", [(SHORT.format(100), "101"), (LONG.format(101), "102")])
    base = ["model.seq_length=64", "rl.rollout.max_new_tokens=6", f"task.datasets={train}",
            f"task.eval_datasets={bench}", "task.num_eval=4"]
    check_config(_cfg(tmp_path, *base))
    check_config(_cfg(tmp_path, *base, f"{EVAL}=20"))  # room for 45 tokens: both rows fit
    with pytest.raises(ValueError, match=rf"bench\.jsonl:2: a prompt of \d+ tokens does not fit: model\.seq_length="
                                         rf"64 leaves \d+ tokens before {EVAL}=30; raise model\.seq_length to \d+ or "
                                         rf"more, lower {EVAL} to \d+ or less.*\(1 of the 2 held-out prompts of"):
        check_config(_cfg(tmp_path, *base, f"{EVAL}=30"))


def test_a_generated_held_out_set_skips_what_does_not_fit_the_evaluation_cap_and_training_keeps_its_own(
        tmp_path, caplog):
    from megatron_logra.rl.loop import prompt_room, rl_prompt_ids

    base = ["model.seq_length=40", "task.num_eval=12", f"task.dataset_kwargs={LONGER}"]
    plain, tok = _task(_cfg(tmp_path, *base), tmp_path)
    before = [p.prompt for p in plain.eval_problems()]
    cfg = _cfg(tmp_path, *base, f"{EVAL}=14")  # training room 35 (max_new_tokens 6), held-out room 27
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.task"):
        task, _ = _task(cfg, tmp_path)
        held_out = [p.prompt for p in task.eval_problems()]
    length = lambda prompt: len(rl_prompt_ids(tok, cfg.rl, prompt))  # noqa: E731
    room, eval_room = prompt_room(cfg), prompt_room(cfg, held_out=True)
    assert (room, eval_room) == (35, 27)
    assert any(eval_room < length(p) <= room for p in before)  # the case this is about
    assert len(held_out) == 12 and all(length(p) <= eval_room for p in held_out)
    assert [p for p in before if length(p) <= eval_room] == held_out[:sum(length(p) <= eval_room for p in before)]
    (warned,) = [r.getMessage() for r in caplog.records if "held-out prompts that do not fit" in r.getMessage()]
    assert f"{EVAL}=14" in warned and f"lower {EVAL} to keep them" in warned, warned
    # training prompts keep rl.rollout.max_new_tokens: the same stream as without the field, longer than 27 too
    trained = [task.train_problem(i).prompt for i in range(60)]
    assert trained == [plain.train_problem(i).prompt for i in range(60)]
    assert any(length(p) > eval_room for p in trained)


def test_no_held_out_prompt_fitting_the_evaluation_cap_names_it(tmp_path):
    from megatron_logra.rl.evaluation import no_held_out_reason

    cfg = _cfg(tmp_path, "model.seq_length=40", "task.num_eval=4", f"task.dataset_kwargs={LONGER}", f"{EVAL}=22")
    task, _ = _task(cfg, tmp_path)  # 19 tokens of room: the shortest chain_sum prompt has 20
    assert task.eval_problems() == []
    level, why = no_held_out_reason(cfg, task)
    assert level == logging.WARNING and f"model.seq_length=40 with {EVAL}=22" in why and f"lower {EVAL}" in why, why


def test_an_evaluation_cap_that_leaves_no_room_for_any_prompt_is_refused_naming_both_fields(tmp_path):
    from megatron_logra.rl.components import check_config

    with pytest.raises(ValueError, match=rf"^{EVAL}=49 leaves no room for any held-out prompt: model\.seq_length=48 "
                                         rf"holds a prompt of P tokens and all but the last of its new tokens.*raise "
                                         rf"model\.seq_length .* or lower {EVAL}"):
        check_config(_cfg(tmp_path, "model.seq_length=48", "task.num_eval=4", f"{EVAL}=49"))
    check_config(_cfg(tmp_path, "model.seq_length=48", "task.num_eval=0", f"{EVAL}=49"))  # nothing is evaluated


def test_a_generated_benchmark_none_of_whose_prompts_fits_the_evaluation_cap_is_refused(tmp_path):
    from megatron_logra.rl.components import check_config

    base = ["model.seq_length=128", "task.eval_datasets=gcd", "task.num_eval=4"]
    check_config(_cfg(tmp_path, *base))  # gcd prompts (~85 tokens) fit the training cap's room
    with pytest.raises(ValueError, match=rf"task\.eval_datasets: 'gcd' has no held-out prompt that fits: .* do not "
                                         rf"fit the 69 tokens of room that model\.seq_length=128 leaves before "
                                         rf"{EVAL}=60.* or lower {EVAL} to \d+ or less"):
        check_config(_cfg(tmp_path, *base, f"{EVAL}=60"))


def test_the_evaluations_prompt_check_names_its_field(tmp_path):
    from megatron_logra.rl.loop import check_prompt_fits

    cfg = _cfg(tmp_path, "model.seq_length=40", "rl.rollout.max_new_tokens=6", f"{EVAL}=20")
    check_prompt_fits(cfg, 30, "x")  # training: 35 tokens of room
    with pytest.raises(ValueError, match=rf"a prompt of 30 tokens does not fit: model\.seq_length=40 leaves 21 tokens "
                                         rf"before {EVAL}=20; raise model\.seq_length to 49 or more, lower {EVAL} to "
                                         rf"11 or less"):
        check_prompt_fits(cfg, 30, "x", held_out=True)
    plain = _cfg(tmp_path, "model.seq_length=40", "rl.rollout.max_new_tokens=6")
    check_prompt_fits(plain, 35, "x", held_out=True)  # without the field the held-out room is the training one
    with pytest.raises(ValueError, match=r"before rl\.rollout\.max_new_tokens=6; raise model\.seq_length to 41"):
        check_prompt_fits(plain, 36, "x", held_out=True)

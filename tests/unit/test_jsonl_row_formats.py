"""The row formats of prepared RL datasets a ``jsonl:`` file may hold: slime's (``{"prompt": [one user message],
"label": ...}`` with ``--input-key`` / ``--label-key``), verl's (``reward_model.ground_truth``), GSM8K's (a worked
solution ending in ``#### 72``) and any keys named by ``task.jsonl_prompt_key`` / ``task.jsonl_answer_key``. Each
row becomes the problem a plain ``{"prompt", "answer"}`` row of the same text would, scored by math-verify."""

from __future__ import annotations

import json

import pytest

from megatron_logra.rewards import TaskConfig, build_task, load_jsonl_problems

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _file(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _pairs(problems):
    return [(p.prompt, p.answer) for p in problems]


def test_slime_and_verl_rows_read_as_plain_rows(tmp_path):
    slime = {"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "label": "42"}
    verl = {"prompt": [{"role": "user", "content": "What is 2 plus 2?"}], "data_source": "gsm8k",
            "reward_model": {"style": "rule", "ground_truth": "4"}}
    gsm8k = {"question": "Tom has 3 apples and buys 4 more. How many?",
             "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"}
    problems = load_jsonl_problems(_file(tmp_path, [slime, verl, gsm8k]))
    assert _pairs(problems) == [("What is 6 times 7?", "42"), ("What is 2 plus 2?", "4"),
                                ("Tom has 3 apples and buys 4 more. How many?", "7")]
    assert problems[1].metadata["data_source"] == "gsm8k"  # the other keys stay in the metadata


def test_a_hash_mark_that_is_not_the_last_line_stays_in_the_answer(tmp_path):
    (problem,) = load_jsonl_problems(_file(tmp_path, [{"prompt": "p", "answer": "#### 5 is the count"}]))
    assert problem.answer == "5 is the count"  # a one-line answer that starts with the mark is GSM8K's too
    (problem,) = load_jsonl_problems(_file(tmp_path, [{"prompt": "p", "answer": "a #### b\nc"}], "b.jsonl"))
    assert problem.answer == "a #### b\nc"


def test_named_keys_and_dotted_keys(tmp_path):
    rows = [{"query": "Compute 9 - 4.", "meta": {"gt": 5}, "answer": "not this one"}]
    path = _file(tmp_path, rows)
    (problem,) = load_jsonl_problems(path, prompt_key="query", answer_key="meta.gt")
    assert (problem.prompt, problem.answer) == ("Compute 9 - 4.", "5")
    with pytest.raises(ValueError, match=rf"{path}:1: no 'label' \(task\.jsonl_answer_key\); keys present: "):
        load_jsonl_problems(path, prompt_key="query", answer_key="label")
    with pytest.raises(ValueError, match=rf"{path}:1: no 'input' \(task\.jsonl_prompt_key\)"):
        load_jsonl_problems(path, prompt_key="input")


@pytest.mark.parametrize("prompt,match", [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
     r"'prompt' is a list of 2 messages with roles \['system', 'user'\]; .* a system prompt belongs in "
     r"rl\.prompt_template"),
    ([{"role": "assistant", "content": "4"}], r"roles \['assistant'\]"),
    ([{"role": "user", "content": 4}], r"roles \['user'\]"),
    ([], r"a list of 0 messages"),
])
def test_other_message_lists_are_refused_naming_the_row(tmp_path, prompt, match):
    path = _file(tmp_path, [{"prompt": prompt, "answer": "4"}])
    with pytest.raises(ValueError, match=rf"{path}:1: .*{match}"):
        load_jsonl_problems(path)


def test_the_task_reads_a_slime_file_with_its_launch_flags_and_scores_it(tmp_path):
    from megatron_logra.config import parse_args_to_config

    rows = [{"input": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gt": {"value": str(2 * i)}}
            for i in range(40)]
    path = _file(tmp_path, rows)
    cfg = parse_args_to_config("tiny", [f"task.datasets=jsonl:{path}", "--input-key", "input",
                                        "--label-key", "gt.value"])
    assert (cfg.task.jsonl_prompt_key, cfg.task.jsonl_answer_key) == ("input", "gt.value")
    task = build_task(cfg.task)
    problem = task.train_problem(0)
    want = 2 * int(problem.prompt.split()[2])
    assert task.score(problem, f"\\boxed{{{want}}}")[1] is True
    assert task.score(problem, f"\\boxed{{{want + 1}}}")[1] is False


@pytest.mark.parametrize("field,value", [("jsonl_prompt_key", " q"), ("jsonl_answer_key", "a..b"),
                                         ("jsonl_answer_key", ".b")])
def test_malformed_keys_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"task\.{field}={value!r}: give a key of the rows"):
        TaskConfig(**{field: value})

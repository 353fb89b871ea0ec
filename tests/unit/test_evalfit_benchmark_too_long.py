"""A held-out benchmark (``task.eval_datasets``) none of whose prompts fits ``model.seq_length`` (with room for
``rl.rollout.max_new_tokens``, by the rule the training datasets follow) is refused at start, in ``train`` and in
``eval``, with one error line naming the benchmark, how many of its prompts do not fit and the
``model.seq_length`` (or ``rl.rollout.max_new_tokens``) that fits them; before, every one of them was skipped with a
warning and the run reported ``eval_accuracy/gcd: null`` throughout. A benchmark some of whose prompts fit keeps
today's behaviour: a generated one skips the others (one warning), a ``jsonl:`` file is refused naming its longest
row. The expected token counts are computed here with the run's tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from megatron_logra.config import parse_args_to_config
from support.cli import exit_2
from support.run_fixtures import run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

# chain_sum with 2..6 one-digit terms: prompts of 20 to 36 tokens with the tiny recipe's tokenizer
LONGER = {"min_terms": 2, "max_terms": 6, "min_digits": 1, "max_digits": 1}


def _bench(tmp_path: Path) -> str:
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i} plus one", "answer": str(i + 1)}) + "\n"
                            for i in range(5)))
    return f"jsonl:{path}"


def _token_counts(tokenizer_dir, cfg, source: str) -> list[int]:
    """Prompt tokens of each held-out problem of the benchmark ``source``: BOS, then ``rl.prompt_template``
    around the prompt, tokenized by the tokenizer saved in ``tokenizer_dir``."""
    from transformers import AutoTokenizer

    from megatron_logra.rewards import build_task

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    problems = [p for p in build_task(cfg.task).benchmark_problems() if p.source == source]
    assert problems
    return [len(bos + tok(cfg.rl.prompt_template.replace("{prompt}", p.prompt), add_special_tokens=False)["input_ids"])
            for p in problems]


def _error_line(err: str) -> str:
    (line,) = [line for line in err.splitlines() if line.startswith("megatron-logra: error: ")]
    return line


def test_train_refuses_a_benchmark_of_which_no_prompt_fits_before_any_step(tmp_path, capsys):
    run = tmp_path / "run"
    args = [f"train.run_dir={run}", f"task.eval_datasets={_bench(tmp_path)},gcd", "model.seq_length=48",
            "train.progress=false"]
    cfg = parse_args_to_config("tiny", args)
    counts = _token_counts(cfg.tokenizer.path, cfg, "gcd")
    new_tokens = cfg.rl.rollout.max_new_tokens
    room = 48 + 1 - new_tokens
    assert min(counts) > room  # the case: no gcd prompt fits (and the file's short rows all do)
    line = _error_line(exit_2(["train", "tiny", *args], capsys))
    assert "task.eval_datasets: 'gcd'" in line and "bench.jsonl" not in line, line
    assert f"all {len(counts)} of its prompts" in line, line
    assert f"model.seq_length={48}" in line and f"rl.rollout.max_new_tokens={new_tokens}" in line, line
    assert f"raise model.seq_length to {max(counts) + new_tokens - 1} or more" in line, line
    assert f"the {room} tokens of room" in line, line
    # refused before anything ran: no step's record, no checkpoint
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_the_error_names_the_max_new_tokens_that_fits_when_one_does(tmp_path):
    from megatron_logra.rl.components import check_config

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "task.eval_datasets=gcd",
                                        "model.seq_length=100", "rl.rollout.max_new_tokens=40", "task.num_eval=8"])
    counts = _token_counts(cfg.tokenizer.path, cfg, "gcd")
    assert min(counts) > 100 + 1 - 40 and max(counts) < 100
    with pytest.raises(ValueError) as err:
        check_config(cfg)
    message = str(err.value)
    assert "'gcd'" in message and f"all {len(counts)} of its prompts" in message, message
    assert f"raise model.seq_length to {max(counts) + 40 - 1} or more" in message, message
    assert f"lower rl.rollout.max_new_tokens to {100 + 1 - max(counts)} or less" in message, message


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A one-step tiny run at model.seq_length=48 (the recipe's) with its checkpoint."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("evalfit") / "run"
    run_rl_recipe("tiny", [
        "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64",
        "sft.init_path=", "sft.steps=2", "sft.batch_size=4", "sft.cache=true", "tokenizer.path=",
        "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.micro_batch_size=4",
        "task.num_eval=4", "rl.eval_interval=0", "kl.probe_sequences=1", "kl.probe_max_tokens=2",
        f"train.run_dir={run}", "train.progress=false",
    ])
    yield run
    torch.set_num_threads(before)


def test_eval_refuses_it_too(trained_run, capsys):
    import yaml

    from megatron_logra.config import RunConfig, from_dict

    cfg = from_dict(RunConfig, yaml.safe_load((trained_run / "config.yaml").read_text()))
    cfg.task.eval_datasets = ["gcd"]
    assert cfg.model.seq_length == 48
    counts = _token_counts(trained_run / "tokenizer", cfg, "gcd")
    new_tokens = cfg.rl.rollout.max_new_tokens
    assert len(counts) == 4 and min(counts) > 48 + 1 - new_tokens
    before = sorted(p.relative_to(trained_run) for p in trained_run.rglob("*"))
    line = _error_line(exit_2(["eval", str(trained_run), "task.eval_datasets=gcd"], capsys))
    assert "task.eval_datasets: 'gcd'" in line and "all 4 of its prompts" in line, line
    assert f"raise model.seq_length to {max(counts) + new_tokens - 1} or more" in line, line
    assert sorted(p.relative_to(trained_run) for p in trained_run.rglob("*")) == before


def test_a_generated_benchmark_with_some_prompts_that_fit_skips_the_others(tmp_path, caplog):
    """Today's behaviour, kept: the prompts that fit are evaluated, the others skipped with one warning."""
    from megatron_logra.rl.components import _task_and_tokenizer

    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.datasets={_bench(tmp_path)}",
                                        "task.eval_datasets=chain_sum", "model.seq_length=30", "task.num_eval=12",
                                        "task.dataset_kwargs=" + json.dumps({"chain_sum": LONGER})])
    room = 30 + 1 - cfg.rl.rollout.max_new_tokens
    counts = _token_counts(cfg.tokenizer.path, cfg, "chain_sum")
    fitting = sum(n <= room for n in counts)
    assert 0 < fitting < len(counts)  # the case: some fit, some do not
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rewards.task"):
        task, _, _ = _task_and_tokenizer(cfg, tmp_path / "run", will_save=False)
        assert len(task.eval_problems()) == fitting
    warned = [r.getMessage() for r in caplog.records if "held-out prompts that do not fit are skipped" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("chain_sum: "), warned


def test_a_jsonl_benchmark_with_one_long_row_is_still_refused_naming_the_row(tmp_path):
    from megatron_logra.rl.components import check_config

    path = tmp_path / "bench.jsonl"
    rows = [("what is 1 plus one", "2"), (" ".join(["what is 1 plus one"] * 20), "2")]
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", f"task.eval_datasets=jsonl:{path}"])
    with pytest.raises(ValueError, match=rf"{path}:2: a prompt of \d+ tokens does not fit.*1 of the 2 prompts"):
        check_config(cfg)

"""``megatron-logra eval RUN`` (and the summary of the RL job) on a tiny trained run.

* A run with a KL penalty (``rl.loss.kl_coef > 0``) and ``sync.transport=directory``: evaluation changes no file
  of the run (it syncs its engine in process) and builds no reference model, so it never runs the
  reference's warm start. Observable: the warm start of this run is a supervised one cached in
  ``RUN/../.cache/warm_start_*.safetensors``; with the cache removed, a reference warm start would train and
  write it again (and log "warm start").
* A run whose ``RUN/tokenizer`` is missing: eval warns, naming the missing directory and the tokenizer it used,
  and writes nothing into the run directory.
* ``task.num_eval=0``: ``summary.json`` holds ``null`` (strict JSON), and ``eval`` is refused naming
  ``task.num_eval`` and the fix.
* A corrupt ``meta.json`` or a truncated shard of the latest checkpoint is reported naming that file, not
  ``config.yaml``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from support.cli import eval_ok as _eval
from support.run_fixtures import run_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _train(run: Path, *extra: str) -> dict:
    return run_rl_recipe("tiny", [
        "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64",
        "sft.init_path=", "sft.steps=2", "sft.batch_size=4", "sft.cache=true", "tokenizer.path=",
        "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.micro_batch_size=4",
        "task.num_eval=4", "rl.eval_interval=0", "kl.probe_sequences=1", "kl.probe_max_tokens=2",
        f"train.run_dir={run}", "train.progress=false", *extra,
    ])


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("evalfix")
    run = root / "run"
    _train(run, "rl.loss.kl_coef=0.05", "sync.transport=directory")  # delta files and anchors in RUN/deltas
    yield run
    torch.set_num_threads(before)


def _files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_eval_of_a_kl_run_builds_no_reference_model(kl_run, capsys, caplog):
    cache = kl_run.parent / ".cache"
    assert any(cache.glob("warm_start_*.safetensors"))  # the run's own warm start was cached
    shutil.rmtree(cache)
    before = _files(kl_run)
    assert any(p.parts[0] == "deltas" for p in before)
    with caplog.at_level(logging.INFO):
        _eval(kl_run)
    assert _files(kl_run) == before  # nothing the run wrote changes: not its delta files, not its anchors
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 1 and out["num_eval"] == 4 and 0 <= out["eval_accuracy"] <= 1
    assert not cache.exists(), "eval ran (and cached) a warm start for a reference model it does not use"
    assert "warm start" not in caplog.text


def test_eval_without_the_runs_tokenizer_warns_and_writes_nothing(kl_run, tmp_path, capsys, caplog):
    run = tmp_path / "run"
    shutil.copytree(kl_run, run)
    shutil.rmtree(run / "tokenizer")
    before = _files(run)
    with caplog.at_level(logging.WARNING):
        _eval(run)
    assert 0 <= json.loads(capsys.readouterr().out)["eval_accuracy"] <= 1
    assert not (run / "tokenizer").exists() and _files(run) == before
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is missing" in r.message]
    assert len(warned) == 1, caplog.text
    assert str(run / "tokenizer") in warned[0] and "words tokenizer built for the task" in warned[0]


def test_num_eval_0_writes_null_and_eval_is_refused(kl_run, capsys):
    run = kl_run.parent / "run_no_eval"
    summary = _train(run, "task.num_eval=0")
    assert summary["eval_accuracy_before"] is None and summary["eval_accuracy_after"] is None
    saved = _strict_json((run / "summary.json").read_text())
    assert saved["eval_accuracy_before"] is None and saved["eval_accuracy_after"] is None
    from megatron_logra.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["eval", str(run)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "task.num_eval=0" in err and "task.num_eval=N" in err
    _eval(run, "task.num_eval=3")  # the fix the message names works
    out = _strict_json(capsys.readouterr().out)
    assert out["num_eval"] == 3 and 0 <= out["eval_accuracy"] <= 1


@pytest.mark.parametrize("broken", ["meta.json", "shard"])
def test_a_broken_checkpoint_is_reported_as_itself_not_as_config_yaml(kl_run, tmp_path, capsys, broken):
    from megatron_logra.checkpoint import latest_checkpoint
    from megatron_logra.cli import main

    run = tmp_path / "run"
    shutil.copytree(kl_run, run)
    ckpt = latest_checkpoint(run)
    if broken == "meta.json":
        meta = ckpt / "meta.json"
        meta.write_text(meta.read_text()[:40])
        named = str(meta)
    else:
        shard = max((p for p in ckpt.rglob("*.distcp")), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[:1000])
        named = f"{ckpt}: {shard.relative_to(ckpt)} has 1000 bytes"
    with pytest.raises(SystemExit) as info:
        main(["eval", str(run)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2
    assert line.startswith(f"megatron-logra: error: {named}"), line
    assert "config.yaml" not in line


def test_train_resume_true_in_a_new_run_dir_does_not_warn_of_a_missing_tokenizer(tmp_path, caplog):
    """``train.resume=true`` where no checkpoint exists yet starts a new run, which writes its tokenizer: the
    missing-tokenizer warning is for a resumed run only (tested above through eval)."""
    torch.set_num_threads(1)
    with caplog.at_level(logging.WARNING):
        _train(tmp_path / "run", "train.resume=true")
    assert not [r for r in caplog.records if "is missing" in r.getMessage()], caplog.text
    assert (tmp_path / "run" / "tokenizer").is_dir()


def test_eval_scores_the_run_on_a_benchmark_it_never_saw(kl_run, tmp_path, capsys):
    """``eval RUN task.eval_datasets=jsonl:FILE`` evaluates on that file's rows (not the run's own held-out set),
    names it in the output and changes nothing the run wrote."""
    rows = [(f"State the final answer to the following arithmetic problem: {a} + {b} =", str(a + b))
            for a in range(3) for b in range(2)]
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    before = _files(kl_run)
    _eval(kl_run, f"task.eval_datasets=jsonl:{bench}", "task.num_eval=100")  # the run's own num_eval is 4
    out = _strict_json(capsys.readouterr().out)
    assert out["num_eval"] == len(rows) and out["eval_sources"] == [f"jsonl:{bench}"]
    assert 0 <= out["eval_accuracy"] <= 1 and out["eval_accuracy"] * len(rows) == round(out["eval_accuracy"] * len(rows))
    assert _files(kl_run) == before
    _eval(kl_run)
    assert _strict_json(capsys.readouterr().out)["eval_sources"] == ["chain_sum"]

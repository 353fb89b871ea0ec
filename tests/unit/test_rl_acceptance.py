"""The RL job as a user runs it: what its errors say, and what ``megatron-logra plot`` draws.

* A prompt that cannot fit ``model.seq_length`` with ``rl.rollout.max_new_tokens`` names values of both
  fields that fit (it said "leaves -51 tokens" when ``max_new_tokens`` alone exceeded the sequence), and
  the start-up check of the held-out prompts reports the longest one, so its suggestion fits them all.
* A bad ``sft.*`` value names that field and its value (one message listed all three fields).
* The plot's held-out curve starts at update 0 with the summary's accuracy before training, and its
  x axis counts whole updates.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest

from megatron_logra.config import parse_args_to_config


def _fix_values(message: str) -> tuple[int, int | None]:
    """The ``model.seq_length`` and ``rl.rollout.max_new_tokens`` (None: not offered) an error suggests."""
    seq = int(re.search(r"raise model\.seq_length to (\d+) or more", message).group(1))
    lower = re.search(r"lower rl\.rollout\.max_new_tokens to (\d+) or less", message)
    return seq, int(lower.group(1)) if lower else None


@pytest.mark.parametrize("seq_length, max_new_tokens, prompt, room", [
    (48, 100, 24, None),  # max_new_tokens alone exceeds the sequence
    (48, 49, 24, None),  # ... fills it: not even a one-token prompt fits
    (48, 30, 24, 19),  # a prompt longer than the room left
    (20, 8, 30, 13),  # a prompt longer than the sequence: no max_new_tokens fits it
])
def test_a_prompt_that_does_not_fit_names_values_that_do(seq_length, max_new_tokens, prompt, room):
    from megatron_logra.rl.loop import check_prompt_fits

    cfg = parse_args_to_config("tiny", [f"model.seq_length={seq_length}",
                                        f"rl.rollout.max_new_tokens={max_new_tokens}"])
    with pytest.raises(ValueError) as exc:
        check_prompt_fits(cfg, prompt, "What is 1 + 2?")
    message = str(exc.value)
    assert message.startswith(f"a prompt of {prompt} tokens does not fit: model.seq_length={seq_length} ")
    assert "-" not in message.split("(prompt starts")[0], message  # no negative room
    if room is not None:
        assert f"leaves {room} tokens before rl.rollout.max_new_tokens={max_new_tokens}" in message
    else:
        assert f"leaves no room for any prompt before rl.rollout.max_new_tokens={max_new_tokens}" in message
    seq, new_tokens = _fix_values(message)
    # each suggestion alone makes the prompt fit, and it is the bound: one less does not
    check_prompt_fits(parse_args_to_config("tiny", [f"model.seq_length={seq}",
                                                    f"rl.rollout.max_new_tokens={max_new_tokens}"]), prompt, "x")
    with pytest.raises(ValueError):
        check_prompt_fits(parse_args_to_config("tiny", [f"model.seq_length={seq - 1}",
                                                        f"rl.rollout.max_new_tokens={max_new_tokens}"]), prompt, "x")
    if prompt <= seq_length:
        assert new_tokens is not None and new_tokens >= 1
        check_prompt_fits(parse_args_to_config("tiny", [f"model.seq_length={seq_length}",
                                                        f"rl.rollout.max_new_tokens={new_tokens}"]), prompt, "x")
        with pytest.raises(ValueError):
            check_prompt_fits(parse_args_to_config("tiny", [f"model.seq_length={seq_length}",
                                                            f"rl.rollout.max_new_tokens={new_tokens + 1}"]),
                              prompt, "x")
    else:
        assert new_tokens is None


def test_the_start_up_check_names_a_seq_length_that_fits(tmp_path, one_thread):
    """With no generated prompt fitting (over-long ones are skipped, so only this is refused), the error names
    the source, the room, and a model.seq_length that fits the prompt it shows; nothing is written."""
    from megatron_logra.data.tokenizer import build_tokenizer
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.job import run_rl
    from megatron_logra.rl.loop import rl_prompt_ids

    mixture = ["task.num_eval=16", "task.datasets=chain_sum,gcd"]
    base = parse_args_to_config("tiny", mixture)
    tok = build_tokenizer(base.tokenizer, [])
    task = build_task(base.task)
    lengths = [len(rl_prompt_ids(tok, base.rl, p.prompt)) for p in task.eval_problems()]
    lengths += [len(rl_prompt_ids(tok, base.rl, task.train_problem(i).prompt)) for i in range(200)]
    seq_length = min(lengths) + base.rl.rollout.max_new_tokens - 2  # leaves room for one token less than any
    cfg = parse_args_to_config("tiny", [*mixture, f"model.seq_length={seq_length}",
                                        f"train.run_dir={tmp_path / 'run'}", "train.progress=false"])
    destroy_parallel()
    try:
        with warnings.catch_warnings(), pytest.raises(ValueError) as exc:
            warnings.simplefilter("ignore")
            run_rl(cfg)
    finally:
        destroy_parallel()
    message = str(exc.value)
    assert re.match(r"task\.datasets: '(chain_sum|gcd)' has no training prompts that fit", message), message
    shown = int(re.search(r"the last one: a prompt of (\d+) tokens does not fit the (\d+) tokens of room", message)[1])
    room = seq_length + 1 - base.rl.rollout.max_new_tokens
    assert f"the {room} tokens of room" in message and shown > room
    assert f"model.seq_length={shown + base.rl.rollout.max_new_tokens - 1} fits it" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("override, named", [
    ("sft.steps=-1", "sft.steps=-1 must be >= 0"),
    ("sft.batch_size=0", "sft.batch_size=0 must be >= 1"),
    ("sft.lr=0", "sft.lr=0.0 must be > 0"),
    ("sft.lr=-0.5", "sft.lr=-0.5 must be > 0"),
])
def test_a_bad_warm_start_value_names_its_field_and_value(override, named):
    with pytest.raises(ValueError) as exc:
        parse_args_to_config("tiny", [override])
    assert str(exc.value).startswith(named), str(exc.value)


def _rl_record(step: int, **extra) -> dict:
    record = {"step": step, "reward_mean": 0.1 * step, "accuracy": 0.2, "eval_accuracy": None, "kl_predicted": 1e-3,
              "kl_actual": 1e-3, "budget": 1e-3, "alpha": 0.5, "update_ratio": 1e-4, "memory_bytes": 2**30}
    record.update(extra)
    return record


@pytest.fixture
def figures(monkeypatch):
    """The figures plot_run saves (the real save_figure still writes each file)."""
    import megatron_logra.plot as plot

    seen, real = [], plot.save_figure

    def keep(fig, path, **kwargs):
        seen.append({ax.get_title(): ax for ax in fig.axes if ax.get_title()}
                    | {"_twins": [ax for ax in fig.axes if not ax.get_title()]})
        return real(fig, path, **kwargs)

    monkeypatch.setattr(plot, "save_figure", keep)
    return seen


def _held_out_line(axes: dict):
    (line,) = [ln for ln in axes["reward and accuracy"].get_lines() if ln.get_label() == "held-out accuracy"]
    return list(line.get_xdata()), list(line.get_ydata())


def test_the_held_out_curve_starts_before_training(tmp_path, figures):
    from megatron_logra.plot import plot_run

    run = tmp_path / "run"
    run.mkdir()
    records = [_rl_record(s, eval_accuracy=0.75 if s == 3 else None) for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_run(run)  # no summary yet (a run in progress): the recorded evaluations only
    assert _held_out_line(figures[-1]) == ([3], [0.75])

    (run / "summary.json").write_text(json.dumps({"steps": 3, "eval_accuracy_before": 0.25, "resumed_from_step": 0}))
    out = plot_run(run)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = figures[-1]
    assert _held_out_line(axes) == ([0, 3], [0.25, 0.75])
    ticks = [t for t in axes["KL per update"].get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks  # whole updates, not 1.5
    twin_lines = [ln.get_label() for ax in axes["_twins"] for ln in ax.get_lines()]
    assert "‖ΔW‖/‖W‖" in twin_lines
    legends = [ax.get_legend() for ax in [axes["step size α"], *axes["_twins"]] if ax.get_legend() is not None]
    assert [sorted(t.get_text() for t in legend.get_texts()) for legend in legends] == [["α", "‖ΔW‖/‖W‖"]]

    # unmeasured before training (task.num_eval=0), or a summary that is no JSON object: nothing added
    for text in (json.dumps({"eval_accuracy_before": None}), "[1]", "{torn"):
        (run / "summary.json").write_text(text)
        plot_run(run)
        assert _held_out_line(figures[-1]) == ([3], [0.75])


def test_an_uncontrolled_logra_run_records_no_kl_budget(tmp_path):
    """``kl.mode=none``: α is 1 and no controller sizes the step, so no budget is recorded (it logged the
    decaying budget of a controller that never acted, as the dense AdamW run once did); the actual KL is still
    measured."""
    from test_rl_e2e import alternating_score, built_components

    from megatron_logra.rl.loop import rl_update

    with built_components(tmp_path / "run", "kl.mode=none") as (comps, state):
        comps.task.score = alternating_score()
        rec = rl_update(comps, state)
    assert not rec.get("skipped")
    assert rec["alpha"] == 1.0 and rec["kl_predicted"] is None and rec["budget"] is None
    assert rec["kl_actual"] is not None and rec["kl_actual"] > 0


def test_a_too_long_training_prompt_of_a_file_is_refused_at_start(tmp_path, one_thread, monkeypatch):
    """A JSONL source is in memory: its training prompts are checked at start with the held-out ones (a long
    training prompt failed only when first drawn, after the model and the engine were built)."""
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rewards import build_task
    from megatron_logra.rl import components, job

    rows = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(40)]
    base = parse_args_to_config("tiny", [f"task.datasets=jsonl:{tmp_path / 'probe.jsonl'}"])
    (tmp_path / "probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    probe = build_task(base.task)
    long = next(p for k in range(100) if not probe.is_eval_prompt(p := "1 + 1 " * 300 + f"= {k}"))
    rows.append({"prompt": long, "answer": "2"})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_args_to_config("tiny", [f"task.datasets=jsonl:{data}", f"train.run_dir={tmp_path / 'run'}",
                                        "task.num_eval=8", "train.progress=false"])
    assert all(p.prompt != long for p in build_task(cfg.task).eval_problems())  # a training prompt only

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the file's prompts were checked")

    monkeypatch.setattr(components, "build_gpt", no_model)
    destroy_parallel()
    try:
        with warnings.catch_warnings(), pytest.raises(ValueError, match=r"a prompt of \d+ tokens does not fit.*"
                                                                         r"prompt starts '1 \+ 1 1 \+ 1"):
            warnings.simplefilter("ignore")
            job.run_rl(cfg)
    finally:
        destroy_parallel()

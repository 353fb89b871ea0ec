"""`megatron-logra memory` and `megatron-logra bench paper` as a user runs them: errors that name the flag,
the engine-fraction row's promise, repeated seeds / optimizers, `--render-only` of another run's JSON, and the
27B / 1.5B counts against arithmetic done by hand from the shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_logra.bench.cli import main as bench_main
from megatron_logra.memory.cli import main as memory_main, resolve_planned_model
from support.scripts import exit_code

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
H100 = 81559 * 2**20  # what nvidia-smi reports for an "80 GB" H100


def _mixtral(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,
                                "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "num_hidden_layers": 2, "vocab_size": 1000, "num_local_experts": 4,
                                "num_experts_per_tok": 2}))
    return path


@pytest.mark.parametrize("argv, start", [
    (["--model", "qwen2.5-7b", "--tp", "3"], "--tp: tp=3 must divide"),
    (["--model", "qwen2.5-7b", "--rank", "-4"], "--rank: rank=-4 "),
    (["--model", "qwen2.5-7b", "--engine-fraction", "1.5"], "--engine-fraction: engine_fraction=1.5 "),
    (["--model", "qwen2.5-7b", "--micro-batch", "0"], "--micro-batch: micro_batch=0 "),
    (["--model", "qwen2.5-7b", "--gpu-memory", "0GiB"], "--gpu-memory 0GiB"),
    (["--model", "qwen2.5-7b", "--gpu-memory", "80XB"], "--gpu-memory 80XB"),
    (["--model", "qwen2.5-7b", "--targets", "bogus"], "--targets: targets: 'bogus'"),
    (["--model", "no-such-preset"], "--model: model='no-such-preset'"),
    (["--model", "MIXTRAL"], "--model MIXTRAL: "),
])
def test_memory_bad_input_is_one_line_naming_the_flag(tmp_path, capsys, argv, start):
    if "MIXTRAL" in argv:  # a config.json of an architecture the trainer does not load
        path = str(_mixtral(tmp_path))
        argv, start = ["--model", path], f"--model {path}: "
    assert exit_code(memory_main, argv) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"megatron-logra memory: error: {start}"), line
    assert "Traceback" not in err


def _plan(model: str, **kw):
    from megatron_logra.memory import PlanConfig, plan

    return plan(resolve_planned_model(model, seq_length=4096), PlanConfig(**kw))


def test_max_engine_fraction_row_keeps_its_promise():
    """The row says the largest --engine-fraction that fits: planning that fraction must fit and 0.01 more must
    not. For 27B dense AdamW on an H100 (TP 8, full recompute) the true limit is 6.5%: 0.07 would be OOM."""
    from megatron_logra.memory.report import breakdown_rows

    settings = dict(tp=8, rank=128, recompute="full", gpu_memory_bytes=H100)
    for optimizer in ("adam", "logra"):
        p = _plan("27b", optimizer=optimizer, engine_fraction=0.3, **settings)
        _, rows = breakdown_rows([p])
        fit_text, free_text = dict((r[0], r[1]) for r in rows)["max engine fraction: fit / >=15% free"].split(" / ")
        shown = float(fit_text)
        assert _plan("27b", optimizer=optimizer, engine_fraction=shown, **settings).fits
        assert not _plan("27b", optimizer=optimizer, engine_fraction=round(shown + 0.01, 2), **settings).fits
        if optimizer == "adam":
            # dense AdamW without any engine: 74.47 GiB of 79.65 GiB is 6.5% free, below 15%
            assert shown == 0.06 and free_text == "none"
        else:
            assert 0.15 <= float(free_text) < shown


def test_max_engine_fraction_none_when_nothing_fits():
    """qwen2.5-7b at TP 2 without recompute is OOM on 80 GiB even without an engine: no fraction is a setting."""
    from megatron_logra.memory.report import breakdown_rows

    p = _plan("qwen2.5-7b", tp=2, optimizer="adam", rank=128, gpu_memory_bytes=80 * GIB)
    assert not p.fits
    _, rows = breakdown_rows([p])
    assert dict((r[0], r[1]) for r in rows)["max engine fraction: fit / >=15% free"] == "none / none"


def test_counts_and_optimizer_state_match_hand_arithmetic():
    """27B (hidden 5376, 62 layers, 32 heads of 168, 16 KV groups, SwiGLU 21504, vocab 262144, tied) and
    qwen2.5-1.5b, worked out from the shapes."""
    from megatron_logra.memory.count import count_params

    h, layers, d, ffn, vocab = 5376, 62, 168, 21504, 262144
    linears = ((32 + 2 * 16) * d * h) + (32 * d * h) + (2 * ffn * h) + (ffn * h)  # qkv, proj, fc1, fc2
    norms = 2 * h
    total = layers * (linears + norms) + vocab * h + h
    assert total == 28_288_237_824
    per_rank = layers * linears // 8 + vocab * h // 8 + layers * norms + h  # norms replicated over TP
    assert per_rank == 3_536_617_728
    model = resolve_planned_model("27b", seq_length=4096)
    assert count_params(model, tp=1).total == total
    assert count_params(model, tp=8).total == per_rank

    worst = _plan("27b", tp=8, optimizer="adam", rank=128, recompute="full", gpu_memory_bytes=H100).worst
    sixteen_bit = per_rank - (layers * norms + h)  # the fp32 norms have no master
    assert worst.grads == 4 * per_rank and worst.moments == 8 * per_rank and worst.masters == 4 * sixteen_bit
    assert worst.weights == 2 * sixteen_bit + 4 * (layers * norms + h)
    # 18 B per 16-bit parameter, 16 per fp32 one
    dense_state = worst.weights + worst.grads + worst.masters + worst.moments
    assert dense_state == 18 * sixteen_bit + 16 * (per_rank - sixteen_bit)

    logra = _plan("27b", tp=8, optimizer="logra", rank=128, recompute="full", gpu_memory_bytes=H100).worst
    rows = layers * ((32 + 2 * 16) * d // 8 + h + 2 * ffn // 8 + h)  # qkv and fc1 sharded; proj, fc2 all rows
    assert logra.sketches == 4 * 128 * rows and logra.row_moments == 4 * rows
    targets = layers * linears // 8
    per_target = (2 * targets + 4 * targets + logra.sketches + logra.row_moments) / targets
    assert 6.0 < per_target <= 6.3  # README / docs/benchmarks.md: LoGRA with fp32 masters keeps <= 6.3 B per target parameter
    # totals are the sum of their rows
    assert logra.persistent == sum((logra.weights, logra.grads, logra.masters, logra.moments, logra.sketches,
                                    logra.row_moments, logra.reference))

    # qwen2.5-1.5b at TP 2: vocabulary padded to a multiple of 16 x TP = 32 (model.make_vocab_size_divisible_by),
    # which 151936 already is; QKV bias sharded with its rows
    h, layers, ffn = 1536, 28, 8960
    linears = (16 * 128 * h) + (h * h) + (2 * ffn * h) + (ffn * h)
    padded = -(-151936 // 32) * 32
    assert padded == 151936
    per_rank = layers * (linears // 2 + 2048 // 2 + 2 * h) + h + padded // 2 * h
    assert count_params(resolve_planned_model("qwen2.5-1.5b", seq_length=4096), tp=2).total == per_rank


@pytest.mark.parametrize("argv, flag", [
    (["--seeds", "1", "1"], "--seeds"),
    (["--optimizers", "logra", "adam", "logra"], "--optimizers"),
    (["--kl-modes", "k3", "k3"], "--kl-modes"),
    (["--rl-steps", "0"], "--rl-steps"),
])
def test_bench_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, argv, flag):
    """A repeated seed would count one run twice in a mean ± sd (n=2, sd 0); a repeated optimizer twice per seed."""
    code = exit_code(bench_main, ["paper", "--quick", "--render-only", "--out-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"megatron-logra bench paper: error: {flag}") and err.count("\n") == 1, err


def test_render_only_refuses_another_runs_json_of_the_same_name(tmp_path, capsys):
    """A custom run's files are named by the settings that differ (``results-quick-rl-steps_12``); a JSON under that
    name holding another run (a --rl-steps 10 run's, copied or renamed by hand) must not be rendered as --rl-steps 12."""
    (tmp_path / "results").mkdir()
    data = json.loads((REPO / "docs" / "results" / "results-quick.json").read_text())
    data["config"]["rl_steps"] = 10
    data["command"] = "megatron-logra bench paper --quick --rl-steps 10"
    source = tmp_path / "results" / "results-quick-rl-steps_12.json"
    source.write_text(json.dumps(data))
    argv = ["paper", "--quick", "--render-only", "--out-dir", str(tmp_path)]
    assert exit_code(bench_main, argv + ["--rl-steps", "12"]) == 2
    err = capsys.readouterr().err
    assert f"{source} holds the run of `megatron-logra bench paper --quick --rl-steps 10`" in err
    assert "rl_steps: 10 -> 12" in err and err.count("\n") == 1
    assert not (tmp_path / "results-quick-rl-steps_12.md").exists()
    # under its own name, the flags of that run re-render it
    shutil.copy(source, tmp_path / "results" / "results-quick-rl-steps_10.json")
    assert exit_code(bench_main, argv + ["--rl-steps", "10"]) == 0
    assert "--rl-steps 10" in (tmp_path / "results-quick-rl-steps_10.md").read_text()


def test_render_only_of_the_committed_quick_report_reproduces_it(tmp_path):
    shutil.copytree(REPO / "docs" / "results", tmp_path / "results")
    assert bench_main(["paper", "--quick", "--render-only", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "results-quick.md").read_text() == (REPO / "docs" / "results-quick.md").read_text()

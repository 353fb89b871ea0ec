"""tools/memory_stress.py at tiny scale on the CPU: CSV columns and rows, optimizer state LoGRA < dense."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from support import forked

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "memory_stress.py"
TINY = ["--hidden", "64", "--heads", "4", "--layers", "2", "--vocab", "512", "--seq-len", "64", "--micro-batch", "2", "--rank", "8",
        "--chunk-tokens", "48"]


def _tool():
    spec = importlib.util.spec_from_file_location("memory_stress_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read(out: Path) -> list[dict]:
    with open(out / "memory_stress.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_two_cpu_steps_of_each_optimizer(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = forked.python([str(TOOL), "--device", "cpu", *TINY, "--steps", "2", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _read(tmp_path)
    assert list(rows[0]) == _tool().COLUMNS
    assert [(r["optimizer"], r["step"]) for r in rows] == [("logra", "1"), ("logra", "2"), ("adam", "1"), ("adam", "2")]
    for r in rows:
        assert r["device"] == "cpu" and r["world"] == "1" and r["tp"] == "1"
        assert r["tokens_per_step"] == str(2 * 64)
        # CUDA readings are empty on the CPU; the CPU ones are there
        assert r["peak_allocated_bytes"] == r["peak_reserved_bytes"] == r["nvml_peak_used_bytes"] == ""
        for key in ("live_tensor_peak_bytes", "peak_rss_bytes", "optimizer_state_bytes", "predicted_peak_bytes",
                    "predicted_optimizer_state_bytes"):
            assert int(r[key]) > 0, (key, r)
        assert float(r["step_seconds"]) > 0 and float(r["loss"]) == float(r["loss"])
        # the planner's optimizer state is the measured one (same categories, exact counts)
        assert abs(int(r["optimizer_state_bytes"]) - int(r["predicted_optimizer_state_bytes"])) \
            <= 0.01 * int(r["predicted_optimizer_state_bytes"]), r
    state = {r["optimizer"]: int(r["optimizer_state_bytes"]) for r in rows}
    assert state["logra"] < state["adam"], state
    assert (tmp_path / "memory_stress.png").stat().st_size > 1000
    assert "predicted peak" in proc.stdout


def test_dry_run_writes_predictions_only(tmp_path):
    tool = _tool()
    assert tool.main(["--dry-run", *TINY, "--tp", "2", "--out", str(tmp_path)]) == 0
    rows = _read(tmp_path)
    assert [r["optimizer"] for r in rows] == ["logra", "adam"]
    for r in rows:
        assert r["device"] == "meta" and r["tp"] == "2"
        assert int(r["predicted_peak_bytes"]) > 0 and int(r["predicted_optimizer_state_bytes"]) > 0
        assert r["optimizer_state_bytes"] == r["live_tensor_peak_bytes"] == ""
    assert int(rows[0]["predicted_optimizer_state_bytes"]) < int(rows[1]["predicted_optimizer_state_bytes"])
    assert (tmp_path / "memory_stress.png").exists()


def test_nvml_sampler_without_library_is_a_note(monkeypatch, caplog):
    # no pynvml module (or no NVML library): the sampler logs a note and measures nothing
    tool = _tool()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with caplog.at_level("WARNING", logger="memory_stress"):
        sampler = tool.NvmlSampler()
    assert sampler.handle is None and "pynvml" in caplog.text
    with sampler:
        pass
    assert sampler.peak is None


@pytest.mark.parametrize("bad, says", [(["--optimizers", "sgd"], "--optimizers"), (["--steps", "0"], "--steps"),
                                       (["--micro-batches", "0"], "--micro-batches=0"),
                                       (["--micro-batch", "0"], "--micro-batch=0"),
                                       (["--chunk-tokens", "-1"], "--chunk-tokens=-1"),
                                       (["--rank", "128"], "rank=128")])
def test_bad_arguments(bad, says, capsys):
    # refused before any model is built (without --dry-run too) as argparse refuses: exit status 2 and
    # one line naming the argument
    with pytest.raises(SystemExit) as exc:
        _tool().main([*TINY, *bad, "--device", "cpu"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("memory_stress.py: error:") and says in last, last


def test_the_docstring_cpu_example_is_accepted(monkeypatch, tmp_path):
    tool = _tool()
    line = next(x for x in tool.__doc__.splitlines() if "--device cpu" in x)
    argv = line.split("memory_stress.py", 1)[1].split()
    out = argv.index("--out")
    argv[out + 1] = str(tmp_path)
    assert tool.main([*argv, "--dry-run"]) == 0


@pytest.mark.parametrize("extra, chunk, loss", [([], 48, "logprob"), (["--chunk-tokens", "0"], 0, "logprob"),
                                                (["--loss", "lm"], 48, "lm")])
def test_dry_run_plans_the_chunking_and_loss_asked_for(tmp_path, extra, chunk, loss):
    from megatron_logra.memory import PlanConfig, plan
    from megatron_logra.models.gpt import ModelConfig

    tool = _tool()
    assert tool.main(["--dry-run", *TINY, *extra, "--optimizers", "logra", "--out", str(tmp_path)]) == 0
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=tool.ffn_size(64),
                        vocab_size=512, seq_length=64, params_dtype="bfloat16")
    want = plan(model, PlanConfig(rank=8, micro_batch=2, seq_len=64, distributed_optimizer=False, overhead_bytes=0,
                                  logprob_chunk_tokens=chunk, loss=loss, scaled_native_step=False)).worst.trainer_peak
    assert int(_read(tmp_path)[0]["predicted_peak_bytes"]) == want


def test_the_prediction_plans_an_unscaled_native_step(tmp_path):
    """The tool applies every step at α = 1: LoGRA's native AdamW step copies no masters, so the prediction
    is the plan without ``scaled_native_step`` (the scaled one is 4 B per native parameter higher when the
    optimizer phase is the peak)."""
    from dataclasses import replace

    from megatron_logra.memory import PlanConfig, plan

    tool = _tool()
    # a large vocabulary and a short sequence: the native AdamW step (embedding, output layer) is the peak
    args = tool.build_parser().parse_args(["--dry-run", "--hidden", "64", "--heads", "4", "--layers", "2",
                                           "--vocab", "32000", "--seq-len", "16", "--micro-batch", "1", "--rank",
                                           "8", "--optimizers", "logra", "--out", str(tmp_path)])
    mcfg = tool.model_config(args)
    peak, _ = tool.predicted(mcfg, "logra", args, 1)
    cfg = PlanConfig(rank=args.rank, micro_batch=args.micro_batch, seq_len=args.seq_len, distributed_optimizer=False,
                     overhead_bytes=0, logprob_chunk_tokens=args.chunk_tokens, policy_sync=False)
    unscaled = plan(mcfg, replace(cfg, scaled_native_step=False)).worst
    scaled = plan(mcfg, cfg).worst
    assert peak == unscaled.trainer_peak != scaled.trainer_peak
    assert scaled.adam_working - unscaled.adam_working == 4 * scaled.counts.native

"""Memory planner against the trainer's own optimizer temporaries, the model's head dimension, frozen
non-targets, the configured LoGRA targets, and the ``memory`` command's layout checks.

The optimizer-temporary references are live-tensor measurements (``LiveTensorTracker``) of the trainer's
optimizers on a real megatron GPT on CPU. AdamW runs with ``foreach=True``: the implementation torch picks
by default on CUDA (``torch.optim.optimizer._default_to_fused_or_foreach``), which the planner plans (CPU's
default is the single-tensor loop). The data-parallel flat all-reduce buffer is measured in
``tests/distributed/test_memfix_grad_reduce.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_logra.memory.activations import layer_activations
from megatron_logra.memory.count import count_params
from megatron_logra.memory import PlanConfig, compare, plan
from megatron_logra.models.gpt import ModelConfig

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=128,
            seq_length=32, params_dtype="bfloat16")


def _gpt_with_grads(groups, model: ModelConfig):
    """build_gpt's model after one forward/backward (so every trained parameter has its gradient)."""
    import torch

    from megatron_logra.models.gpt import build_gpt

    gpt = build_gpt(model, groups, seed=1)
    return gpt, lambda: gpt(torch.randint(0, model.vocab_size, (2, model.seq_length)),
                            torch.arange(model.seq_length)[None], None,
                            labels=torch.randint(0, model.vocab_size, (2, model.seq_length))).float().sum().backward()


def _foreach(opt) -> None:
    for group in opt.native.inner.param_groups:
        group["foreach"] = True  # what torch.optim.AdamW picks by default for CUDA tensors


def _peak_above_start(fn) -> int:
    from megatron_logra.memory.measure import LiveTensorTracker

    with LiveTensorTracker() as tracker:
        base = tracker.current
        fn()
    return tracker.peak - base


def test_dense_adamw_temporaries_are_what_the_trainers_adamw_allocates(groups, one_thread):
    """DenseAdamW (the trainer's ``optimizer.name=adam``): the gradient-norm pass holds the fp64 square of
    the largest gradient (16 B per element) and foreach AdamW the square roots of every second moment
    (4 B per parameter); the planner plans exactly these bytes and adds them to the trainer peak."""
    from megatron_logra.optim.config import NativeConfig
    from megatron_logra.optim.dense import DenseAdamW

    model = ModelConfig(**TINY)
    gpt, fwd_bwd = _gpt_with_grads(groups, model)
    opt = DenseAdamW(gpt, NativeConfig(), groups)
    _foreach(opt)
    fwd_bwd()
    opt.step()  # the first step creates the moments (persistent state)
    fwd_bwd()
    update = [None]
    prepare_peak = _peak_above_start(lambda: update.__setitem__(0, opt.prepare()))
    step_peak = _peak_above_start(lambda: opt.apply(update[0]))
    n = opt.native.num_params()
    largest = max(p.numel() for p in opt.native.params)
    scalars = 64  # the fp64 norm accumulator and the finite flag
    assert step_peak == 4 * n and 16 * largest <= prepare_peak <= 16 * largest + scalars

    w = plan(model, optimizer="adam", micro_batch=2, seq_len=32, policy_sync=False).worst
    assert w.counts.total == n
    assert w.adam_working == step_peak and 0 <= prepare_peak - w.grad_working <= scalars
    assert w.optimizer_working == max(w.adam_working, w.grad_working)
    assert dict(w.items())["AdamW step temporaries"] == step_peak
    assert w.trainer_peak == w.persistent + max(w.forward_backward, w.optimizer_working)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_logra_native_adamw_temporaries_and_the_scaled_step_copy(groups, one_thread, alpha):
    """LoGRA's AdamW over the non-targets: 4 B per parameter for foreach AdamW, 4 B more when a step size
    α != 1 scales the native step (``NativeAdamW.step`` keeps a copy of the fp32 masters)."""
    from megatron_logra.optim.config import LograConfig, NativeConfig
    from megatron_logra.optim.logra import LograOptimizer

    model = ModelConfig(**TINY)
    gpt, fwd_bwd = _gpt_with_grads(groups, model)
    opt = LograOptimizer(gpt, LograConfig(rank=4), NativeConfig(), groups)
    _foreach(opt)
    fwd_bwd()
    opt.step()
    fwd_bwd()
    opt.prepare()
    measured = _peak_above_start(lambda: opt.native.step(scale=alpha))
    n = opt.native.num_params()
    assert measured == (4 if alpha == 1.0 else 8) * n

    w = plan(model, rank=4, micro_batch=2, seq_len=32, policy_sync=False, scaled_native_step=alpha != 1.0).worst
    assert w.counts.native == n
    assert w.adam_working == measured
    # the directions stay alive through the native step; the largest target update came before it
    directions = w.step_working - w.largest_update
    assert w.optimizer_working == max(w.grad_working, directions + max(w.largest_update, measured))


def test_frozen_non_targets_have_no_adamw_state_or_temporaries(groups, one_thread):
    """``optimizer.native.freeze``: the trainer steps no parameter with AdamW; the plan has no grads, no
    non-target masters, no moments and no AdamW temporaries, and the LoGRA persistent state is what the
    optimizer reports."""
    from megatron_logra.optim.config import LograConfig, NativeConfig
    from megatron_logra.optim.logra import LograOptimizer

    model = ModelConfig(**TINY)
    gpt, _ = _gpt_with_grads(groups, model)
    opt = LograOptimizer(gpt, LograConfig(rank=4), NativeConfig(freeze=True), groups)
    assert opt.native.num_params() == 0
    trained = plan(model, rank=4, micro_batch=2, seq_len=32).worst
    frozen = plan(model, rank=4, micro_batch=2, seq_len=32, freeze_native=True).worst
    c = frozen.counts
    assert (frozen.grads, frozen.moments, frozen.grad_working, frozen.adam_working) == (0, 0, 0, 0)
    assert frozen.masters == 4 * c.target_low_precision
    assert trained.persistent - frozen.persistent == 4 * c.native + 4 * c.native_low_precision + 8 * c.native
    assert sum(opt.persistent_bytes().values()) == frozen.persistent - frozen.weights
    with pytest.raises(ValueError, match="freeze_native"):
        PlanConfig(optimizer="adam", freeze_native=True)
    dense, logra = compare(model, PlanConfig(rank=4, micro_batch=2, seq_len=32, freeze_native=True))
    assert dense.worst.grads == 4 * c.total and logra.worst.grads == 0


def test_the_configured_targets_are_planned(groups, one_thread):
    """``optimizer.logra.targets``: the sketches the trainer installs (rows, ranks) and the AdamW split
    follow the configured list; aliases select their kind; a tied output layer is refused as install_sketches
    refuses it."""
    import torch

    from megatron_logra.optim.config import LograConfig, NativeConfig
    from megatron_logra.optim.logra import LograOptimizer

    model = ModelConfig(**{**TINY, "untie_embeddings_and_output_weights": True})
    for targets in (["linear_qkv", "linear_fc2"], ["o_proj"], ["linear_fc1", "output_layer"]):
        gpt, _ = _gpt_with_grads(groups, model)
        opt = LograOptimizer(gpt, LograConfig(rank=4, targets=targets), NativeConfig(), groups)
        w = plan(model, rank=4, micro_batch=2, seq_len=32, targets=tuple(targets)).worst
        assert w.sketches == opt.sketches.flat.numel() * 4, targets
        assert w.counts.native == opt.native.num_params(), targets
        assert w.masters == 4 * sum(t.weight.numel() for t in opt.targets if t.weight.dtype != torch.float32) + \
            4 * sum(p.numel() for p in opt.native.params if p.dtype != torch.float32), targets
        opt.sketches.remove()
    tied = ModelConfig(**{**TINY, "untie_embeddings_and_output_weights": False})
    with pytest.raises(ValueError, match="output_layer"):
        plan(tied, rank=4, targets=("output_layer",))
    with pytest.raises(ValueError, match="targets"):
        PlanConfig(targets=("embedding",))


def test_activations_use_the_models_head_dimension():
    """Qwen3-like shape: 32 heads of 128 channels on a hidden size of 2560 (attention width 4096, not
    2560); the attention-output projection reads 4096 columns, and the activations say so."""
    base = ModelConfig(num_layers=2, hidden_size=2560, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=9728, vocab_size=151936, seq_length=4096, params_dtype="bfloat16")
    b, s, t = 1, 4096, 1
    T = b * s
    for kv_channels in (None, 128, 64):
        m = replace(base, kv_channels=kv_channels)
        d = kv_channels or 2560 // 32
        q, kv = 32 * d, 8 * d
        proj = [x for x in count_params(m).targets if x.kind == "linear_proj"][0]
        assert proj.n_in == q
        unfused = layer_activations(m, tp=t, micro_batch=b, seq_len=s)
        flash = layer_activations(m, tp=t, micro_batch=b, seq_len=s, attention="flash")
        assert unfused.proj_input == 2 * T * proj.n_in
        assert unfused.attention == 3 * 2 * T * q + 6 * 32 * T * s
        assert flash.attention == 2 * T * (2 * q + 3 * kv) + 4 * 32 * T


@pytest.mark.parametrize("argv, says", [
    (["--tp", "0", "--gpus", "8"], "tp=0 must be an integer >= 1"),
    (["--tp", "-2"], "tp=-2 must be an integer >= 1"),
    (["--tp", "two", "--gpus", "8"], "give an integer >= 1 or auto"),
    (["--freeze-native", "--optimizer", "adam"], "--freeze-native applies to LoGRA"),
    (["--targets", "embedding"], "targets: 'embedding' is not a target the planner models"),
    (["--distributed-optimizer", "--no-distributed-optimizer"], "contradict"),
])
def test_memory_cli_refuses_bad_layouts_with_a_clear_error(capsys, argv, says):
    from megatron_logra.memory.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "qwen2.5-1.5b", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_memory_cli_defaults_plan_what_the_trainer_runs(capsys):
    """The command's defaults are the trainer's: AdamW states whole on every DP rank (its preflight plans
    ``distributed_optimizer=False``); ``--distributed-optimizer`` plans Megatron-LM's sharding."""
    from megatron_logra.memory.cli import main
    from megatron_logra.memory.units import GiB, format_bytes
    from megatron_logra.models.presets import get_preset

    argv = ["--model", "qwen2.5-7b", "--tp", "4", "--gpus", "8", "--optimizer", "adam", "--markdown"]
    assert main(argv) == 0
    default = capsys.readouterr().out
    assert main(argv + ["--distributed-optimizer"]) == 0
    sharded = capsys.readouterr().out
    whole = plan(get_preset("qwen2.5-7b"), tp=4, dp=2, optimizer="adam").worst
    split = plan(get_preset("qwen2.5-7b"), tp=4, dp=2, optimizer="adam", distributed_optimizer=True).worst
    assert f"| total | {format_bytes(whole.total)} |" in default
    assert f"| total | {format_bytes(split.total)} |" in sharded and "(dist. opt.)" in sharded
    assert whole.moments == 8 * whole.counts.total and split.moments == 8 * whole.counts.total // 2
    assert whole.grad_working == 4 * whole.counts.total and split.grad_working == split.adam_working == 0
    assert whole.total - split.total > 10 * GiB


def _flat_shell(text: str) -> str:
    return " ".join(line.lstrip("# ").rstrip("\\").strip() for line in text.splitlines())


def test_the_27b_launchers_plan_command_plans_what_the_runs_preflight_plans(capsys):
    """``examples/train_27b_8gpu.sh``'s "check the plan first" command, with the 27b preset for the checkpoint's
    config.json: its LoGRA column is the recipe's own preflight (micro-batch, engine share, frozen non-targets)."""
    import re
    import shlex
    from pathlib import Path

    from megatron_logra.memory.cli import main
    from megatron_logra.memory.preflight import memory_preflight
    from megatron_logra.memory.units import format_bytes, parse_bytes
    from megatron_logra.config import parse_args_to_config

    script = (Path(__file__).resolve().parents[2] / "examples" / "train_27b_8gpu.sh").read_text()
    command = re.search(r"megatron-logra memory (--model .*?--compare)", _flat_shell(script)).group(1)
    argv = shlex.split(command.replace('"$HF_PATH/config.json"', "27b"))
    assert main(argv + ["--markdown"]) == 0
    out = capsys.readouterr().out
    run = memory_preflight(parse_args_to_config("27b", []), tp=8, pp=1, dp=1, gpu_memory_bytes=parse_bytes("81559MiB"))
    assert re.search(rf"\| total \| [0-9.]+ GiB \| {re.escape(format_bytes(run.worst.total))} \|", out), out
    assert f"| {run.verdict} |" in out and "| OOM (" in out  # and dense AdamW does not fit


def test_the_help_texts_node_table_command_prints_the_documented_table(capsys):
    """``megatron-logra memory --help`` says its last example prints the node table of docs/memory.md."""
    import re
    import shlex
    from pathlib import Path

    from megatron_logra.memory import cli

    doc = _flat_shell(cli.__doc__)
    command = re.search(r"megatron-logra memory (--model qwen2\.5-1\.5b,qwen2\.5-7b,27b .*?--markdown)", doc).group(1)
    assert cli.main(shlex.split(command)) == 0
    lines = capsys.readouterr().out.splitlines()
    table = "\n".join(lines[:lines.index("")])
    assert table.count("\n") == 7
    assert table in (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()

"""Memory preflight (``train.memory_check``): the planner's verdict for a run's own config.

References are built independently: the planner called with the layout, batch and engine share
a user would type for the 27B recipe (``megatron-logra memory --model 27b --tp 8 --rank 128
--recompute full --engine-fraction 0.3 --micro-batch 2 --freeze-native``), and the embedded engine's
bytes from the model's parameter count.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_logra.memory import PlanConfig, plan
from megatron_logra.memory.preflight import MemoryCheckError, memory_preflight, run_plan_config, unmodelled
from megatron_logra.memory.units import GiB, parse_bytes
from megatron_logra.models.presets import get_preset
from megatron_logra.config import parse_args_to_config

H100 = parse_bytes("81559MiB")


def test_the_27b_recipe_plans_like_the_documented_command():
    cfg = parse_args_to_config("27b", [])
    got = memory_preflight(cfg, tp=8, pp=1, dp=1, gpu_memory_bytes=H100)
    want = plan(get_preset("27b"), PlanConfig(tp=8, rank=128, recompute="full", engine_fraction=0.3, micro_batch=2,
                                              seq_len=4096, gpu_memory_bytes=H100, distributed_optimizer=False,
                                              freeze_native=True))  # the recipe freezes the non-targets
    assert got is not None and got.fits
    assert got.worst.total == want.worst.total and got.headroom == pytest.approx(want.headroom)
    assert got.headroom >= 0.15  # the headline: LoGRA at 27B on one 8 x 80 GB node, with room to spare
    dense_cfg = parse_args_to_config("27b", ["optimizer.name=adam", "native.freeze=false", "kl.mode=none"])
    dense = memory_preflight(dense_cfg, tp=8, pp=1, dp=1, gpu_memory_bytes=H100)
    assert dense is not None and not dense.fits


def test_the_run_config_maps_frozen_non_targets_targets_and_kl_control():
    """``optimizer.native.freeze``, ``optimizer.logra.targets`` and a KL controller scaling the native step
    reach the plan; a frozen run plans no AdamW state at all."""
    frozen = run_plan_config(parse_args_to_config("27b", []), tp=8, pp=1, dp=1, gpu_memory_bytes=H100)
    assert frozen.freeze_native and frozen.targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    w = plan(get_preset("27b"), frozen).worst
    assert (w.grads, w.moments, w.adam_working, w.grad_working) == (0, 0, 0, 0)
    trained = run_plan_config(parse_args_to_config("27b", ["native.freeze=false", "logra.targets=[q_proj,down_proj]"]),
                              tp=8, pp=1, dp=1, gpu_memory_bytes=H100)
    assert not trained.freeze_native and trained.scaled_native_step
    assert trained.targets == ("linear_qkv", "linear_fc2")
    off = run_plan_config(parse_args_to_config("27b", ["native.freeze=false", "kl.mode=none"]), tp=8, pp=1, dp=1,
                          gpu_memory_bytes=H100)
    assert not off.scaled_native_step
    lm = run_plan_config(parse_args_to_config("lm-tiny", []), tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB)
    assert not lm.scaled_native_step  # the LM job applies every step in full


def test_the_embedded_engine_holds_a_whole_copy_in_the_compute_dtype():
    cfg = parse_args_to_config("tiny", ["model.params_dtype=bfloat16"])
    pcfg = run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB)
    assert pcfg is not None
    assert pcfg.engine_fraction * 8 * GiB == pytest.approx(cfg.model.num_params() * 2)
    assert (pcfg.micro_batch, pcfg.seq_len, pcfg.rank) == (cfg.rl.micro_batch_size, cfg.model.seq_length, 32)
    server = parse_args_to_config("tiny", ["rl.rollout.engine=sglang", "rl.rollout.sglang_url=http://h:30000"])
    assert run_plan_config(server, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB).engine_fraction == 0.0
    lm = parse_args_to_config("lm-tiny", [])
    lm_cfg = run_plan_config(lm, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB)
    assert (lm_cfg.engine_fraction, lm_cfg.micro_batch, lm_cfg.logprob_chunk_tokens) == \
        (0.0, lm.train.micro_batch_size, 0)


def test_a_run_that_does_not_fit_warns_or_is_refused(caplog):
    small = parse_bytes("24GiB")
    cfg = parse_args_to_config("27b", [])
    with caplog.at_level(logging.WARNING, logger="megatron_logra.memory.preflight"):
        result = memory_preflight(cfg, tp=8, pp=1, dp=1, gpu_memory_bytes=small)
    assert result is not None and not result.fits
    assert "does not fit its GPU" in caplog.text and "train.memory_check=off" in caplog.text
    refused = parse_args_to_config("27b", ["train.memory_check=error"])
    with pytest.raises(MemoryCheckError, match="does not fit its GPU: LoGRA r=128: OOM") as exc:
        memory_preflight(refused, tp=8, pp=1, dp=1, gpu_memory_bytes=small)
    assert isinstance(exc.value, ValueError)  # reported as a user error by the CLI
    off = parse_args_to_config("27b", ["train.memory_check=off"])
    assert memory_preflight(off, tp=8, pp=1, dp=1, gpu_memory_bytes=small) is None


def test_without_a_gpu_nothing_is_planned_and_bad_modes_are_refused():
    import torch

    if not torch.cuda.is_available():
        assert memory_preflight(parse_args_to_config("tiny", []), tp=1, pp=1, dp=1) is None
    with pytest.raises(ValueError, match="train.memory_check='maybe': choose off, warn or error"):
        parse_args_to_config("tiny", ["train.memory_check=maybe"])


def test_the_rl_job_checks_before_building_the_model(tmp_path, monkeypatch):
    """With a (pretend) 1 GiB device, ``train.memory_check=error`` stops the job before any model
    is built or any file is written (the device query is the only thing replaced: no CUDA here)."""
    from megatron_logra.memory import preflight
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl

    monkeypatch.setattr(preflight, "_device_memory", lambda: 1 * GiB)
    cfg = parse_args_to_config("tiny", [f"train.run_dir={tmp_path / 'run'}", "train.memory_check=error",
                                        "model.num_layers=8", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
                                        "model.num_attention_heads=8"])
    destroy_parallel()
    try:
        with pytest.raises(MemoryCheckError, match="OOM"):
            run_rl(cfg)
    finally:
        destroy_parallel()
    assert not (tmp_path / "run").exists()


def test_a_kl_penalty_plans_its_reference_model_and_what_is_left_out_is_named():
    """The reference model of a KL penalty is this rank's weights once more, in the persistent state
    and so in every peak; what the planner does not model (fp8) is named for the log line."""
    cfg = parse_args_to_config("27b", ["rl.loss.kl_coef=0.05"])
    plain = parse_args_to_config("27b", [])
    assert run_plan_config(cfg, tp=8, pp=1, dp=1, gpu_memory_bytes=H100).reference_model
    assert not run_plan_config(plain, tp=8, pp=1, dp=1, gpu_memory_bytes=H100).reference_model
    got, base = (memory_preflight(c, tp=8, pp=1, dp=1, gpu_memory_bytes=H100).worst for c in (cfg, plain))
    assert base.reference == 0 and got.reference == base.weights > 0
    assert got.persistent - base.persistent == got.total - base.total == base.weights
    assert unmodelled(cfg) == unmodelled(plain) == []
    fp8 = parse_args_to_config("27b", [])
    fp8.model.fp8 = "hybrid"  # set after parsing: the TE spec it needs cannot be configured without TE
    assert [m.split(" (")[0] for m in unmodelled(fp8)] == ["fp8"]


def test_the_lm_job_plans_its_own_micro_batches_and_no_policy_sync():
    cfg = parse_args_to_config("lm-tiny", ["model.seq_length=4096"])  # the model can take longer than the task
    pcfg = run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB)
    assert pcfg is not None
    # the lm job's micro-batches are [train.micro_batch_size, data.seq_length - 1] (the task's input tokens)
    assert (pcfg.micro_batch, pcfg.seq_len) == (cfg.train.micro_batch_size, cfg.data.seq_length - 1)
    assert (pcfg.loss, pcfg.policy_sync) == ("lm", False)
    w = plan(cfg.model, pcfg).worst
    assert w.sync_working == 0 and w.sync_peak == w.persistent  # nothing is streamed to an engine
    rl = run_plan_config(parse_args_to_config("tiny", []), tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB)
    assert (rl.loss, rl.policy_sync) == ("logprob", True)


def test_the_lm_loss_term_matches_megatrons_measured_cross_entropy(groups, one_thread):
    """The LM job's loss (megatron's vocab-parallel cross entropy over bf16 logits): the planner's
    logits + working set against the live-tensor peak of a real forward and backward."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_logra.memory.activations import logit_bytes
    from megatron_logra.memory.count import count_params
    from megatron_logra.memory.measure import LiveTensorTracker
    from megatron_logra.models.gpt import ModelConfig

    s, b, hidden, vocab = 128, 2, 16, 4096
    model = ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, ffn_hidden_size=32, vocab_size=vocab,
                        seq_length=s, params_dtype="bfloat16", make_vocab_size_divisible_by=128)
    h = torch.randn(s, b, hidden, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, vocab, (b, s))
    with LiveTensorTracker() as tracker:
        base = tracker.current
        logits = h @ weight.t()  # [s, b, V], the output layer's bf16 logits
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous())
        del logits
        loss.sum().backward()
    # the only other live tensors at the peak: the [s, b] loss and h's gradient (tiny next to s*b*V)
    measured = tracker.peak - base - 4 * s * b - 2 * s * b * hidden
    got = sum(logit_bytes(model, count_params(model), tp=1, micro_batch=b, seq_len=s, chunk_tokens=0, loss="lm"))
    assert count_params(model).padded_vocab == vocab
    assert abs(got - measured) <= 0.02 * measured, (got, measured)


def test_attention_is_planned_as_the_model_would_be_built_here():
    """TransformerEngine layers run fused attention (no s x s scores) in 16-bit and their unfused fallback in
    fp32, megatron's local spec the unfused one; ``auto`` is TE exactly where TE can be used. The preflight
    and the stress tool both plan through ``attention_kernel``."""
    from types import SimpleNamespace

    from megatron_logra.memory.preflight import attention_kernel
    from megatron_logra.models.te import te_unavailable_reason

    def model(impl, dtype="bfloat16"):
        return SimpleNamespace(transformer_impl=impl, params_dtype=dtype)

    assert attention_kernel(model("transformer_engine")) == "flash"
    assert attention_kernel(model("transformer_engine", "float16")) == "flash"
    assert attention_kernel(model("transformer_engine", "float32")) == "unfused"
    assert attention_kernel(model("local")) == "unfused"
    here = "unfused" if te_unavailable_reason() is not None else "flash"
    assert attention_kernel(model("auto")) == here
    cfg = parse_args_to_config("tiny", [])
    assert cfg.model.params_dtype == "float32"
    assert run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=H100).attention == "unfused"
    cfg = parse_args_to_config("tiny", ["--bf16"])
    assert run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=H100).attention == here


def test_the_hint_names_only_changes_the_run_has_not_made(caplog):
    """27B already recomputes in full: "set model.recompute=full" was suggested anyway."""
    small = parse_bytes("24GiB")
    with caplog.at_level(logging.WARNING, logger="megatron_logra.memory.preflight"):
        memory_preflight(parse_args_to_config("27b", []), tp=8, pp=1, dp=1, gpu_memory_bytes=small)
    assert "does not fit its GPU" in caplog.text and "recompute" not in caplog.text
    assert "rl.micro_batch_size=2" in caplog.text and "rl.rollout.mem_fraction_static (now 0.30)" in caplog.text
    assert "optimizer.logra.rank (now 128)" in caplog.text
    caplog.clear()
    lean = parse_args_to_config("27b", ["model.recompute=none", "rl.micro_batch_size=1"])
    with caplog.at_level(logging.WARNING, logger="megatron_logra.memory.preflight"):
        memory_preflight(lean, tp=8, pp=1, dp=1, gpu_memory_bytes=small)
    assert "set model.recompute=full (now none)" in caplog.text and "micro_batch_size" not in caplog.text


@pytest.mark.parametrize("dp", [1, 2])
def test_a_micro_batch_larger_than_a_ranks_rows_plans_what_the_trainer_runs(dp):
    """``split_microbatches`` never makes a micro-batch larger than a rank's rows: raising
    ``rl.micro_batch_size`` past them changes nothing the trainer runs, nor the plan (nor, with
    ``memory_check=error``, the verdict)."""
    from megatron_logra.rl.batching import split_microbatches
    from megatron_logra.rl.config import share_per_rank
    from megatron_logra.train.step import Batch

    base = ["rl.prompts_per_step=2", "rl.group_size=2", "train.memory_check=error"]
    rows = share_per_rank("rl.prompts_per_step", 2, dp, "prompts") * 2
    plans = {}
    for mbs in (rows, 8):
        cfg = parse_args_to_config("27b", [f"rl.micro_batch_size={mbs}", *base])
        assert run_plan_config(cfg, tp=8, pp=1, dp=dp, gpu_memory_bytes=H100).micro_batch == rows
        plans[mbs] = memory_preflight(cfg, tp=8, pp=1, dp=dp, gpu_memory_bytes=H100)
        z = torch.zeros(rows, 4, dtype=torch.long)
        batch = Batch(tokens=z, labels=z, loss_mask=z.float(), position_ids=z, extras={})
        assert max(mb.tokens.shape[0] for mb in split_microbatches(batch, mbs)) == rows
    assert plans[rows].worst.total == plans[8].worst.total and plans[8].fits


def test_a_training_warm_start_plans_its_own_micro_batch():
    """A supervised warm start that trains splits ``sft.batch_size / dp`` demonstrations into micro-batches of
    ``rl.micro_batch_size`` too: the larger of its and the RL step's micro-batches is planned."""
    cfg = parse_args_to_config("tiny", ["rl.prompts_per_step=1", "rl.group_size=2", "rl.micro_batch_size=16",
                                        "sft.steps=5", "sft.batch_size=8", "sft.cache=false", "sft.init_path="])
    assert run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB).micro_batch == 8
    # a warm start loaded from sft.init_path does not train
    cfg = parse_args_to_config("tiny", ["rl.prompts_per_step=1", "rl.group_size=2", "rl.micro_batch_size=16",
                                        "sft.steps=5", "sft.batch_size=8"])
    assert cfg.sft.init_path and run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB).micro_batch == 2
    cfg = parse_args_to_config("tiny", ["rl.prompts_per_step=1", "rl.group_size=2", "rl.micro_batch_size=16",
                                        "sft.steps=0"])
    assert run_plan_config(cfg, tp=1, pp=1, dp=1, gpu_memory_bytes=8 * GiB).micro_batch == 2

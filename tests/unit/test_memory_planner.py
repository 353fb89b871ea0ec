"""Memory planner: exact meta-device counts, persistent state vs the optimizer-memory benchmark,
activation formulas, presets / HF loader, unit parsing, errors and the CLI."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from support import forked

from megatron_logra.memory.activations import layer_activations
from megatron_logra.memory.count import count_params
from megatron_logra.memory import PlanConfig, compare, plan
from megatron_logra.memory.units import GiB, format_bytes, parse_bytes
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.presets import PRESETS, get_preset, load_hf_config, resolve_model

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "results" / "optimizer_memory.json"


# ------------------------------------------------------------------ independent closed form
def closed_form(cfg: ModelConfig, tp: int = 1) -> dict:
    """Per-rank counts from the config fields alone (single pipeline stage)."""
    h, a, f = cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size
    g = cfg.num_query_groups or a
    d = h // a
    v = -(-cfg.vocab_size // (16 * tp)) * 16 * tp  # padded to 16 x tp
    qkv_rows = (a + 2 * g) * d
    fc1_rows = (2 if cfg.swiglu else 1) * f
    targets = (qkv_rows * h + h * a * d + fc1_rows * h + h * f) // tp
    bias16 = qkv_rows // tp if (cfg.add_qkv_bias or cfg.add_bias_linear) else 0
    if cfg.add_bias_linear:
        bias16 += fc1_rows // tp + 2 * h  # proj and fc2 biases are replicated
    norms32 = 2 * h + (2 * d if cfg.qk_layernorm else 0)
    L = cfg.num_layers
    emb = v * h // tp
    out = emb if cfg.untie_embeddings_and_output_weights else 0
    native16 = L * bias16 + emb + out
    native32 = L * norms32 + h
    return {
        "targets": L * targets, "native16": native16, "native32": native32,
        "total": L * targets + native16 + native32,
        "rows": L * (qkv_rows // tp + h + fc1_rows // tp + h),
        "cols": L * (h + a * d // tp + h + f // tp),
    }


LAYOUTS = {"qwen2.5-1.5b": 2, "qwen2.5-7b": 4, "27b": 8}


def test_presets_have_the_stated_shapes():
    q15, q7, big = get_preset("qwen2.5-1.5b"), get_preset("qwen2.5-7b"), get_preset("27b")
    assert (q15.hidden_size, q15.num_layers, q15.num_attention_heads, q15.num_query_groups, q15.ffn_hidden_size,
            q15.vocab_size, q15.untie_embeddings_and_output_weights, q15.add_qkv_bias) == \
        (1536, 28, 12, 2, 8960, 151936, False, True)
    assert (q7.hidden_size, q7.num_layers, q7.num_attention_heads, q7.num_query_groups, q7.ffn_hidden_size,
            q7.vocab_size, q7.untie_embeddings_and_output_weights, q7.add_qkv_bias) == \
        (3584, 28, 28, 4, 18944, 152064, True, True)
    assert (big.hidden_size, big.num_layers, big.num_attention_heads, big.num_query_groups, big.ffn_hidden_size,
            big.vocab_size, big.untie_embeddings_and_output_weights) == (5376, 62, 32, 16, 21504, 262144, False)
    for cfg in (q15, q7, big):
        assert cfg.seq_length == 4096 and cfg.params_dtype == "bfloat16"


@pytest.mark.parametrize("name", list(PRESETS))
def test_meta_counts_equal_closed_form(name):
    cfg = get_preset(name)
    for tp in (1, LAYOUTS[name]):
        c, want = count_params(cfg, tp=tp), closed_form(cfg, tp)
        assert c.total == want["total"], (name, tp)
        assert c.target_params == want["targets"]
        assert c.native_low_precision == want["native16"] and c.native_fp32 == want["native32"]
        assert c.target_rows == want["rows"] and c.target_cols == want["cols"]
        assert c.weight_bytes == 2 * (want["targets"] + want["native16"]) + 4 * want["native32"]
    # the headline sizes
    billions = {"qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.62, "27b": 28.29}[name]
    assert round(count_params(cfg).total / 1e9, 2) == billions


def test_pipeline_stages_split_layers_and_keep_a_tied_copy():
    cfg = get_preset("27b")
    first, last = count_params(cfg, tp=8, pp=2, stage=0), count_params(cfg, tp=8, pp=2, stage=1)
    whole = closed_form(cfg, 8)
    emb = 262144 * 5376 // 8
    assert first.num_layers == last.num_layers == 31
    assert first.embedding == emb and first.output_layer == 0
    assert last.embedding == 0 and last.output_layer == emb  # megatron's tied copy on the last stage
    assert first.target_params + last.target_params == whole["targets"]
    assert first.total + last.total == whole["total"] + emb


@pytest.mark.parametrize("name", list(PRESETS))
def test_persistent_state_equals_exact_counts(name):
    cfg, tp = get_preset(name), LAYOUTS[name]
    want = closed_form(cfg, tp)
    total, low = want["total"], want["targets"] + want["native16"]
    native = want["native16"] + want["native32"]
    for dp, dist in ((1, False), (4, True)):
        dense, logra = compare(cfg, PlanConfig(tp=tp, dp=dp, rank=64, distributed_optimizer=dist))
        d, lg = dense.worst, logra.worst
        shard = dp if dist else 1
        assert d.weights == lg.weights == 2 * low + 4 * want["native32"]
        assert (d.grads, d.masters, d.moments) == (4 * total, 4 * low // shard, 8 * total // shard)
        assert d.sketches == d.row_moments == 0
        assert lg.grads == 4 * native
        assert lg.masters == 4 * want["targets"] + 4 * want["native16"] // shard
        assert lg.moments == 8 * native // shard
        assert (lg.sketches, lg.row_moments) == (4 * 64 * want["rows"], 4 * want["rows"])
        assert lg.projection_cache == 4 * 64 * want["cols"]
    bf16 = plan(cfg, tp=tp, rank=64, masters="none").worst
    assert bf16.masters == 4 * want["native16"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_policy_sync_working_set_is_two_largest_full_parameters_and_a_chunk(name):
    """The streamed refit holds one full parameter (its TP shards + their concatenation) and one
    queued chunk; it runs after the step, so the rank needs the larger of the two peaks."""
    from megatron_logra.sync.sglang_payloads import DEFAULT_CHUNK_BYTES

    cfg, tp = get_preset(name), LAYOUTS[name]
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    largest = 2 * max(cfg.padded_vocab_size(tp) * h, (heads + 2 * groups) * d * h, 2 * f * h, h * f, h * heads * d)
    for pp in (1, 2):
        for optimizer in ("adam", "logra"):
            w = plan(cfg, tp=tp, pp=pp, rank=64, optimizer=optimizer).worst
            assert w.sync_working == 2 * largest + DEFAULT_CHUNK_BYTES, (pp, optimizer)
            assert w.total == max(w.trainer_peak, w.persistent + w.sync_working) + w.engine + w.overhead


def _bench_rows():
    if not BENCH.exists():
        pytest.skip(f"{BENCH} missing (run benchmarks/optimizer_memory.py)")
    data = json.loads(BENCH.read_text())
    return data["meta"], data["rows"]


def test_planner_matches_the_measured_optimizer_memory_benchmark():
    meta, rows = _bench_rows()
    assert rows
    for r in rows:
        h = r["hidden"]
        model = ModelConfig(num_layers=r["layers"], hidden_size=h, num_attention_heads=max(1, h // 64),
                            ffn_hidden_size=r["ffn"], vocab_size=meta["vocab"], seq_length=meta["seq"],
                            params_dtype="bfloat16")
        opt = "adam" if r["optimizer"] == "adam" else "logra"
        masters = "none" if r["optimizer"] == "logra_bf16" else "fp32"
        # the benchmark steps megatron's LM loss (forward_backward without a loss_fn): loss="lm"
        w = plan(model, optimizer=opt, rank=r["rank"], masters=masters, micro_batch=meta["micro_batch"],
                 seq_len=meta["seq"], loss="lm", policy_sync=False).worst
        assert w.counts.total == r["model_params"] and w.counts.target_params == r["target_params"]
        per_target = w.target_persistent / w.counts.target_params
        assert per_target == pytest.approx(r["persistent_B_per_target_param"], rel=0.10), r["optimizer"]
        assert w.persistent == pytest.approx(r["persistent_model_bytes"], rel=0.10), r["optimizer"]
        # the whole-step peak of live tensors (CPU, unfused attention) is predicted too: never low, and high by
        # at most the scoring layer's s x s working set ((B + 4)·a·T·s), which the plan adds to every saved set
        # and the logits although this one- and two-layer models' peak (at the loss) does not hold it
        heads, T = max(1, h // 64), meta["micro_batch"] * meta["seq"]
        scoring = (2 + 4) * heads * T * meta["seq"]
        assert w.trainer_peak - scoring <= r["peak_live_bytes"] <= w.trainer_peak, r["optimizer"]


def test_activation_formula_reduces_to_korthikanti():
    # GELU GPT as Korthikanti et al. model it (f = 4h, MHA, 16-bit LayerNorm, learned positions, dropout on):
    # they give T·h·(10 + 24/t) + 5·a·T·s/t with a 16-bit softmax; megatron keeps the softmax output in
    # fp32 (+2 bytes per score), each LayerNorm its fp32 mean and rstd (8 bytes per token), and each layer
    # builds a boolean s x s causal mask.
    h, a, s, b = 1024, 16, 2048, 2
    model = ModelConfig(num_layers=4, hidden_size=h, num_attention_heads=a, ffn_hidden_size=4 * h, vocab_size=64,
                        swiglu=False, hidden_dropout=0.1, attention_dropout=0.1, params_dtype="bfloat16",
                        normalization="LayerNorm", position_embedding_type="learned_absolute")
    T = b * s
    for t in (1, 2, 4, 8):
        layer = layer_activations(model, tp=t, micro_batch=b, seq_len=s)
        assert layer.total == T * h * 10 + T * h * 24 // t + 7 * a * T * s // t + 2 * 8 * T + s * s
    full = plan(model, micro_batch=b, seq_len=s, recompute="full", optimizer="adam").worst.activations
    none = plan(model, micro_batch=b, seq_len=s, recompute="none", optimizer="adam").worst.activations
    layer = layer_activations(model, tp=1, micro_batch=b, seq_len=s).total
    # global score buffer (B = 2 per score), the scoring layer's baddbmm output + fp32 softmax input (2 + 4 per
    # score: the peak breakdown of test_unfused_attention_peak_is_planned), the final norm's input and
    # statistics and its output, which the output layer saves
    extras = 2 * a * T * s + (2 + 4) * a * T * s + (2 * T * h + 8 * T) + 2 * T * h
    assert full == 4 * 2 * T * h + layer + extras
    assert none == 4 * layer + extras


def test_27b_headline_logra_fits_one_80gb_node_where_dense_does_not():
    cfg = PlanConfig(tp=8, dp=1, rank=128, recompute="full", engine_fraction=0.3,
                     gpu_memory_bytes=parse_bytes("81559MiB"))
    dense, logra = compare(get_preset("27b"), cfg)
    assert not dense.fits and "OOM" in dense.verdict
    assert logra.fits and logra.headroom >= 0.15
    # without a colocated engine dense AdamW fits (barely): the claim needs the engine's share
    alone = plan(get_preset("27b"), replace(cfg, optimizer="adam", engine_fraction=0.0))
    assert alone.fits and alone.engine_fraction_limit(0.0) == pytest.approx(dense.engine_fraction_limit(0.0))


def test_hf_config_loader(tmp_path):
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
             "tie_word_embeddings": True, "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen2))
    assert load_hf_config(path) == get_preset("qwen2.5-1.5b")
    assert resolve_model(str(tmp_path)) == get_preset("qwen2.5-1.5b")  # a directory holding config.json
    llama = dict(qwen2, architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
    path.write_text(json.dumps(llama))
    got = load_hf_config(path)
    assert not got.add_qkv_bias and got.untie_embeddings_and_output_weights and not got.qk_layernorm
    path.write_text(json.dumps(dict(qwen2, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128)))
    assert load_hf_config(path).qk_layernorm
    path.write_text(json.dumps(dict(qwen2, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=64)))
    wide = load_hf_config(path)  # head_dim != hidden / heads (1536 / 12 = 128): kv_channels
    assert wide.kv_channels == 64 and wide.head_dim == 64
    path.write_text(json.dumps(dict(qwen2, head_dim=-1)))
    with pytest.raises(ValueError, match="head_dim=-1"):
        load_hf_config(path)
    path.write_text(json.dumps(dict(qwen2, architectures=["GPT2LMHeadModel"], model_type="gpt2")))
    with pytest.raises(ValueError, match="architectures=.*GPT2LMHeadModel.*not supported"):
        load_hf_config(path)
    path.write_text(json.dumps({k: v for k, v in qwen2.items() if k != "intermediate_size"}))
    with pytest.raises(ValueError, match="intermediate_size"):
        load_hf_config(path)


def test_parse_bytes_units():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("81559MiB") == 81559 * 2**20
    assert parse_bytes("1.5e9") == 1_500_000_000 and parse_bytes(1024) == 1024 and parse_bytes("2kib") == 2048
    assert format_bytes(80 * GiB) == "80.00 GiB"
    for bad in ("80 GiBs", "", "-1GB", "GB", "eighty", True, -5, float("nan")):
        with pytest.raises(ValueError, match="gpu_memory="):
            parse_bytes(bad, name="gpu_memory")


@pytest.mark.parametrize("kwargs, field", [
    (dict(tp=8), "tp=8 must divide model.num_attention_heads=12"),
    (dict(tp=3), "tp=3 must divide model.num_query_groups=2"),
    (dict(pp=5), "pp=5 must divide model.num_layers=28"),
    (dict(optimizer="sgd"), "optimizer='sgd'"),
    (dict(masters="bf16"), "masters='bf16'"),
    (dict(recompute="selective"), "recompute='selective'"),
    (dict(engine_fraction=1.0), "engine_fraction=1.0"),
    (dict(micro_batch=0), "micro_batch=0"),
    (dict(rank=9000), "rank=9000"),
    (dict(gpu_memory_bytes=0), "gpu_memory_bytes=0"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        plan(get_preset("qwen2.5-1.5b"), **kwargs)


def test_unknown_model_names_the_field():
    with pytest.raises(ValueError, match="model='llama-9000'.*qwen2.5-7b"):
        resolve_model("llama-9000")
    with pytest.raises(ValueError, match="model='/nonexistent/config.json'"):
        resolve_model("/nonexistent/config.json")


def test_cli_strict_exit_status(capsys):
    from megatron_logra.memory.cli import main

    assert main(["--model", "qwen2.5-1.5b", "--tp", "2", "--gpu-memory", "4GiB", "--strict", "--markdown"]) == 2
    out = capsys.readouterr().out
    assert "OOM" in out and "| weights |" in out
    assert main(["--model", "qwen2.5-1.5b", "--tp", "auto", "--gpus", "8", "--gpu-memory", "80GiB,141GB",
                 "--compare", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.count("TP2 PP1 DP4") >= 2 and "dense AdamW" in out and "LoGRA r=256" in out


def test_cli_compare_subprocess(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 640, "vocab_size": 1000, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, COLUMNS="160")
    proc = forked.python(
        ["-m", "megatron_logra.cli", "memory", "--model", str(tmp_path / "config.json"), "--tp", "2",
         "--rank", "16", "--seq-len", "512", "--gpu-memory", "1GiB", "--engine-fraction", "0.3", "--compare"],
        env=env, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "dense AdamW" in out and "LoGRA r=16" in out
    assert "fit" in out or "OOM" in out
    assert "verdict" in out and "activations" in out


@pytest.mark.parametrize("swiglu", [True, False])
def test_mlp_activation_term_matches_megatrons_saved_tensors(groups, one_thread, swiglu):
    """The MLP term against the tensors autograd saves inside a real megatron MLP (its input excluded)."""
    import torch

    from megatron_logra.models.gpt import build_gpt

    b, s, h, f = 2, 32, 64, 96
    model = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=f, vocab_size=64,
                        seq_length=s, params_dtype="bfloat16", swiglu=swiglu)
    mlp = build_gpt(model, groups, seed=1).decoder.layers[0].mlp
    skip = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    skip.add(x.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    assert layer_activations(model, tp=1, micro_batch=b, seq_len=s).mlp == sum(saved.values())


def test_unfused_attention_peak_is_planned(groups, one_thread):
    """A bf16 GPT's forward and backward (unfused attention, megatron's cross entropy): the live-tensor
    peak against the planned activations + logits; the s x s score temporaries dominate."""
    import torch

    from megatron_logra.memory.activations import activation_bytes, logit_bytes
    from megatron_logra.memory.measure import LiveTensorTracker
    from megatron_logra.models.gpt import build_gpt

    b, s = 1, 512
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=64,
                        seq_length=s, params_dtype="bfloat16")
    gpt = build_gpt(model, groups, seed=1)
    tokens, labels = torch.randint(0, 64, (b, s)), torch.randint(0, 64, (b, s))
    with LiveTensorTracker() as tracker:
        base = tracker.current
        gpt(tokens, torch.arange(s)[None], None, labels=labels).float().sum().backward()
    measured = tracker.peak - base
    counts = count_params(model)
    planned = activation_bytes(model, counts, tp=1, pp=1, micro_batch=b, seq_len=s) + \
        sum(logit_bytes(model, counts, tp=1, micro_batch=b, seq_len=s, loss="lm"))
    assert 0.95 * measured <= planned <= 1.1 * measured, (planned, measured)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_meta_counts_match_the_built_model_dtypes(groups, one_thread, norm, dtype):
    """Weight bytes and fp32 parameters of the meta count against the model build_gpt really builds."""
    import torch

    from megatron_logra.models.gpt import build_gpt

    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=100,
                        seq_length=32, params_dtype=dtype, normalization=norm, untie_embeddings_and_output_weights=True)
    built = list(build_gpt(model, groups, seed=1).parameters())
    c = count_params(model)
    assert c.total == sum(p.numel() for p in built)
    assert c.weight_bytes == sum(p.numel() * p.element_size() for p in built)
    if dtype != "float32":
        assert c.native_fp32 == sum(p.numel() for p in built if p.dtype == torch.float32)


def test_the_reference_model_is_the_built_models_weights_once_more(groups, one_thread):
    """``reference_model`` adds this rank's parameter bytes of the model ``build_gpt`` really builds
    (a bf16 model with fp32 norms) to the persistent state and the total, nothing else."""
    from megatron_logra.models.gpt import build_gpt

    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=100,
                        seq_length=32, params_dtype="bfloat16")
    built = sum(p.numel() * p.element_size() for p in build_gpt(model, groups, seed=1).parameters())
    base, ref = (plan(model, rank=8, micro_batch=2, seq_len=32, reference_model=flag).worst for flag in (False, True))
    assert (base.reference, ref.reference) == (0, built)
    assert ref.persistent - base.persistent == ref.total - base.total == built
    assert dict(ref.items())["reference model"] == built


@pytest.mark.parametrize("name, gpus, pp", [("qwen2.5-7b", 6, 1), ("qwen2.5-7b", 12, 2), ("27b", 6, 1), ("27b", 8, 1),
                                           ("27b", 16, 1)])
def test_cli_auto_tp_splits_the_gpus_into_whole_groups(capsys, name, gpus, pp):
    from megatron_logra.memory.cli import main

    model = get_preset(name)
    heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    per_stage = gpus // pp
    # independently: the largest TP that shards the model, splits this stage's GPUs evenly and stays in an 8-GPU node
    want = max(t for t in range(1, min(per_stage, 8) + 1)
               if heads % t == 0 and groups % t == 0 and model.ffn_hidden_size % t == 0 and per_stage % t == 0)
    assert main(["--model", name, "--tp", "auto", "--gpus", str(gpus), "--pp", str(pp), "--gpu-memory", "141GB",
                 "--markdown"]) in (0, 2)
    assert f"TP{want} PP{pp} DP{gpus // (want * pp)}" in capsys.readouterr().out


def test_rank_is_bounded_by_the_attention_output_width_as_the_trainer_does(groups, one_thread):
    """kv_channels x heads < hidden: linear_proj's input is the narrowest; the planner refuses what the trainer refuses."""
    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.optim import LograConfig, OptimizerConfig, build_optimizer

    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=8, ffn_hidden_size=192,
                        vocab_size=64, seq_length=64, params_dtype="bfloat16")
    for rank in (32, 48):
        try:
            build_optimizer(build_gpt(model, groups, seed=1), OptimizerConfig(logra=LograConfig(rank=rank)), groups)
            trainer_ok = True
        except ValueError:
            trainer_ok = False
        try:
            plan(model, rank=rank, seq_len=64)
            planner_ok = True
        except ValueError as exc:
            planner_ok = False
            assert "linear_proj" in str(exc) and "32" in str(exc)
        assert planner_ok == trainer_ok == (rank <= 4 * 8)


def test_the_documented_layout_table_is_the_tools_output(capsys):
    """docs/usage.md and docs/memory.md show the summary table of the command they print next to it; a
    planner change that moves a figure must move the documented one too."""
    from megatron_logra.memory.cli import main

    assert main(["--model", "qwen2.5-1.5b,qwen2.5-7b,27b", "--tp", "auto", "--gpus", "8", "--gpu-memory",
                 "81559MiB,143771MiB", "--rank", "128", "--recompute", "full", "--engine-fraction", "0.3", "--compare",
                 "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[:lines.index("")]
    assert len(table) == 8 and table[0].startswith("| model |")
    for doc in (REPO / "docs" / "usage.md", REPO / "docs" / "memory.md"):
        text = doc.read_text()
        assert "\n".join(table) in text, f"{doc.name}: the layout table differs from the tool's output"
        assert "--gpu-memory 81559MiB,143771MiB" in text.replace("\\\n    ", "").replace("\n", " ")

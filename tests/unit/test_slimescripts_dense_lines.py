"""The whole argument lines of slime's dense launch scripts (``scripts/models/*.sh`` MODEL_ARGS with the
``scripts/run-*.sh`` arrays) parse here, each flag to its deliberate answer.

Each line is the script's arrays concatenated, as ``ray job submit ... train.py`` receives them, with the slime
flags this trainer spells otherwise replaced by their fields (``--prompt-data`` -> ``task.datasets=jsonl:FILE``,
``--eval-prompt-data NAME FILE`` -> ``task.eval_datasets=jsonl:FILE``, ``--save`` / ``--load`` a tmp directory) and
the ones that must name an existing checkpoint (``--hf-checkpoint``, ``--ref-load``) or carry a secret
(``--wandb-key``) dropped; the ``--sglang-*`` server arguments, which are ``rl.rollout.sglang_engine_args`` here,
are dropped too. The recipes have no ``model.hf_path``, so the MODEL_ARGS set the model's sizes.
"""

import logging

import pytest

from megatron_logra.config.recipe_files import parse_args_to_config

QWEN3_4B = """--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32
 --group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
 --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
 --qk-layernorm"""
QWEN3_32B = """--swiglu --num-layers 64 --hidden-size 5120 --ffn-hidden-size 25600 --num-attention-heads 64
 --group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
 --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
 --qk-layernorm"""
QWEN25_05B = """--swiglu --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 --num-attention-heads 14
 --use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm
 --norm-epsilon 1e-6 --rotary-base 1000000 --group-query-attention --num-query-groups 2 --vocab-size 151936"""
LLAMA31_8B = """--swiglu --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
 --group-query-attention --num-query-groups 8 --max-position-embeddings 131072 --use-rotary-position-embeddings
 --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-5 --rotary-base 500000 --vocab-size 128256
 --kv-channels 128 --use-rope-scaling --rotary-scaling-factor 8.0 --untie-embeddings-and-output-weights"""

ROLLOUT = """--input-key prompt --label-key label --apply-chat-template --rollout-shuffle --rm-type deepscaler
 --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 8192
 --rollout-temperature 0.8 --global-batch-size 256 --balance-data"""
EVAL = """--eval-interval 20 --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 0.7"""
PERF = """--tensor-model-parallel-size {tp} --sequence-parallel --pipeline-model-parallel-size 1
 --context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
 --use-dynamic-batch-size --max-tokens-per-gpu {tokens}"""
GRPO = """--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
 --eps-clip 0.2 --eps-clip-high 0.28"""
OPTIMIZER = """--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9
 --adam-beta2 0.98"""
CPU_OPTIMIZER = "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer"
SGLANG = "--rollout-num-gpus-per-engine {engine_gpus}"
MISC = """--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
 --attention-softmax-in-fp32 --attention-backend flash"""
LAUNCH = "--actor-num-nodes 1 --actor-num-gpus-per-node {gpus} --colocate"

# scripts/run-*.sh (and examples/): (recipe, the arrays in the script's order, the fields asserted)
LINES = {
    "run-qwen3-4B.sh": ("27b", [LAUNCH.format(gpus=8), QWEN3_4B, "--save {run} --load {run} --save-interval 20",
                                "task.datasets=jsonl:{data}", ROLLOUT, OPTIMIZER, GRPO,
                                PERF.format(tp=2, tokens=9216), EVAL, "task.eval_datasets=jsonl:{eval}",
                                SGLANG.format(engine_gpus=2), MISC],
                        dict(tp=2, layers=36, hidden=2560, ffn=9728, heads=32, groups=8, kv=128, vocab=151936,
                             qk_norm=True, qkv_bias=False, untie=False, rope_base=1000000, eps=1e-6, steps=3000)),
    "run-qwen3-32B.sh": ("27b", [LAUNCH.format(gpus=8), QWEN3_32B, "--save {run} --load {run} --save-interval 20",
                                 "task.datasets=jsonl:{data}", ROLLOUT.replace("--num-rollout 3000", "--num-rollout 5"),
                                 OPTIMIZER, CPU_OPTIMIZER, GRPO, PERF.format(tp=8, tokens=20480), EVAL,
                                 "task.eval_datasets=jsonl:{eval}", SGLANG.format(engine_gpus=8), MISC],
                         dict(tp=8, layers=64, hidden=5120, ffn=25600, heads=64, groups=8, kv=128, vocab=151936,
                              qk_norm=True, qkv_bias=False, untie=False, rope_base=1000000, eps=1e-6, steps=5)),
    "run-llama3.1-8B.sh": ("qwen2.5-7b", [LAUNCH.format(gpus=4) + " --rollout-num-gpus-per-node 4", LLAMA31_8B,
                                          "--save {run} --load {run} --save-interval 100",
                                          "task.datasets=jsonl:{data}",
                                          ROLLOUT.replace("deepscaler", "math").replace("--rollout-batch-size 32",
                                                                                         "--rollout-batch-size 64")
                                          .replace("--global-batch-size 256", "--global-batch-size 512")
                                          .replace("--rollout-max-response-len 8192",
                                                   "--rollout-max-prompt-len 256 --rollout-max-response-len 1792"),
                                          # Megatron-LM's qkv bias is off unless --add-qkv-bias; a field the line
                                          # leaves alone keeps the recipe's value (qwen2.5-7b's is on)
                                          "model.add_qkv_bias=false",
                                          OPTIMIZER, GRPO, "--use-wandb --wandb-project slime-dev",
                                          PERF.format(tp=2, tokens=9216), SGLANG.format(engine_gpus=1), MISC],
                           dict(tp=2, layers=32, hidden=4096, ffn=14336, heads=32, groups=8, kv=128, vocab=128256,
                                qk_norm=False, qkv_bias=False, untie=True, rope_base=500000, eps=1e-5, steps=3000,
                                rope_scaling=8.0)),
    "examples/reproducibility/run-qwen2.5-0.5B-gsm8k.sh": (
        "qwen2.5-1.5b", ["--train-backend megatron --actor-num-nodes 1 --actor-num-gpus-per-node 2 "
                         "--rollout-num-gpus 2 --colocate", QWEN25_05B, "task.datasets=jsonl:{data}",
                         "--input-key messages --label-key label --apply-chat-template --rollout-shuffle --rm-type math"
                         " --num-rollout 40 --rollout-batch-size 4 --n-samples-per-prompt 1"
                         " --rollout-max-response-len 2048 --rollout-temperature 0.8 --global-batch-size 4",
                         "--eval-interval 50 --n-samples-per-eval-prompt 1 --eval-max-response-len 512",
                         "task.eval_datasets=jsonl:{eval}",
                         "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1"
                         " --sequence-parallel --use-dynamic-batch-size --max-tokens-per-gpu 8092",
                         GRPO + " --kl-coef 0.00", OPTIMIZER,
                         "--rollout-num-gpus 2 --rollout-num-gpus-per-engine 2",
                         "--calculate-per-token-loss --use-slime-router " + MISC],
        dict(tp=1, layers=24, hidden=896, ffn=4864, heads=14, groups=2, kv=64, vocab=151936, qk_norm=False,
             qkv_bias=True, untie=False, rope_base=1000000, eps=1e-6, steps=40)),
}


@pytest.fixture
def te_installed(monkeypatch):
    """``--attention-backend flash`` selects TransformerEngine (model.transformer_impl=transformer_engine), which
    the config checks is installed: the scripts run on GPU machines that have it."""
    monkeypatch.setattr("megatron_logra.models.te.te_installed", lambda: True)


def _words(arrays, tmp_path):
    data, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    for path in (data, evals):
        path.write_text('{"prompt": "1+1?", "label": "2"}\n')
    text = " ".join(arrays).format(run=tmp_path / "run", data=data, eval=evals)
    # --optimizer adam is dense AdamW here, which the GPU recipes' LoGRA settings refuse (naming these two
    # fields); slime's evaluation samples at the rollout temperature unless --eval-temperature is given, this
    # trainer's greedily, which refuses --n-samples-per-eval-prompt > 1 without it
    return text.split() + ["optimizer.native.freeze=false", "kl.mode=none", "--eval-temperature", "0.8"]


@pytest.mark.parametrize("script", sorted(LINES))
def test_a_dense_script_line_parses_to_its_model_and_layout(script, tmp_path, te_installed):
    recipe, arrays, want = LINES[script]
    words = _words(arrays, tmp_path)
    if "run-qwen2.5-0.5B-gsm8k" in script:  # a speed benchmark of one sample per prompt: see the test below
        words[words.index("--n-samples-per-prompt") + 1] = "2"
        words[words.index("--global-batch-size") + 1] = "8"
    cfg = parse_args_to_config(recipe, words)
    model = cfg.model
    assert cfg.parallel.tp == want["tp"] and cfg.parallel.pp == 1
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (want["layers"], want["hidden"], want["ffn"])
    assert (model.num_attention_heads, model.num_query_groups) == (want["heads"], want["groups"])
    assert model.kv_channels in (want["kv"], None) and model.vocab_size == want["vocab"]
    assert model.swiglu is True and model.add_bias_linear is False and model.normalization == "RMSNorm"
    assert model.qk_layernorm is want["qk_norm"] and model.add_qkv_bias is want["qkv_bias"]
    assert model.untie_embeddings_and_output_weights is want["untie"]
    assert model.position_embedding_type == "rope" and model.rotary_base == want["rope_base"]
    assert model.layernorm_epsilon == pytest.approx(want["eps"])
    assert model.rope_scaling_factor == want.get("rope_scaling", model.rope_scaling_factor)
    assert model.recompute == "full" and model.transformer_impl == "transformer_engine"
    assert model.hidden_dropout == 0.0 and model.attention_dropout == 0.0
    assert cfg.optimizer.name == "adam" and cfg.optimizer.native.lr == pytest.approx(1e-6)
    assert cfg.optimizer.schedule.decay_style == "constant"
    assert cfg.rl.steps == want["steps"] and cfg.rl.loss.kl_coef == 0.0


def test_one_sample_per_prompt_under_grpo_is_the_reproducibility_lines_only_refusal(tmp_path, te_installed):
    recipe, arrays, _ = LINES["examples/reproducibility/run-qwen2.5-0.5B-gsm8k.sh"]
    with pytest.raises(ValueError, match=r"^rl.group_size=1 with rl.advantage.estimator=grpo gives every sample an "
                                         r"advantage of 0"):
        parse_args_to_config(recipe, _words(arrays, tmp_path))


def test_the_cpu_optimizer_flags_are_accepted_with_a_reason(tmp_path, te_installed, caplog):
    recipe, arrays, _ = LINES["run-qwen3-32B.sh"]
    with caplog.at_level(logging.WARNING):
        parse_args_to_config(recipe, _words(arrays, tmp_path))
    for flag in ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"):
        assert f"{flag} is accepted and ignored" in caplog.text


def test_rotary_scaling_factor_sets_nothing_llama_scaling_is_use_rope_scaling(te_installed):
    cfg = parse_args_to_config("qwen2.5-7b", ["--use-rope-scaling", "--rope-scaling-factor", "16",
                                              "--rotary-scaling-factor", "8.0", "--attention-backend", "local"])
    assert cfg.model.rope_scaling_factor == 16.0  # Megatron-LM reads --rotary-scaling-factor for YaRN only


@pytest.mark.parametrize("words, message", [
    (["--tis-level", "geometric"], "sequence and geometric levels are not supported"),
    (["--rotary-interleaved"], "interleaved RoPE (GLM-4's) is not supported"),
    (["--deterministic-mode"], "enable_deterministic_inference"),
    (["--spec", "slime_plugins.models.glm4", "get_glm_spec"], "custom layer specs"),
    (["--multi-latent-attention"], "multi-latent attention"),
    (["--kv-lora-rank", "512"], "multi-latent attention"),
])
def test_script_flags_this_trainer_cannot_honour_are_refused_naming_why(words, message):
    with pytest.raises(ValueError, match="is a Megatron-LM flag this trainer cannot honour|--tis-level") as err:
        parse_args_to_config("tiny", words)
    assert message in str(err.value)


def test_tis_level_token_is_this_trainers_own():
    assert parse_args_to_config("tiny", ["--use-tis", "--tis-level", "token"]).rl.loss.kind == "tis"


def test_the_glm4_line_is_refused_for_each_of_its_non_llama_parts():
    glm4 = """--spec slime_plugins.models.glm4 get_glm_spec --swiglu --num-layers 40 --hidden-size 4096
     --ffn-hidden-size 13696 --num-attention-heads 32 --group-query-attention --num-query-groups 2
     --use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-5
     --rotary-base 10000 --vocab-size 151552 --post-self-attn-layernorm --post-mlp-layernorm --rotary-interleaved
     --rotary-percent 0.5 --no-rope-fusion --untie-embeddings-and-output-weights""".split()
    with pytest.raises(ValueError) as err:
        parse_args_to_config("qwen2.5-7b", glm4)
    message = str(err.value)
    assert message.startswith("5 of the command line's options cannot be used")
    for flag in ("--spec", "--post-self-attn-layernorm", "--post-mlp-layernorm", "--rotary-interleaved",
                 "--rotary-percent=0.5"):
        assert flag in message
    assert "unknown option" not in message

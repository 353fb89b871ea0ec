"""A mixture-of-experts model's slime launch line (Qwen3-30B-A3B's, DeepSeek-V3's MODEL_ARGS) gets one refusal
naming its MoE flags, not one line per flag it holds."""

import pytest

from megatron_logra.config.recipe_files import parse_args_to_config

QWEN3_30B_A3B = """--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32
 --num-query-groups 4 --kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu
 --untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 1000000 --moe-ffn-hidden-size 768
 --moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 8
 --moe-layer-freq '([1]*48)' --num-experts 128 --moe-grouped-gemm --moe-token-drop-policy probs
 --moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0
 --hf-checkpoint /root/Qwen3-30B-A3B --ref-load /root/Qwen3-30B-A3B_torch_dist
 --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --tensor-model-parallel-size 4 --sequence-parallel
 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --optimizer-cpu-offload
 --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer --use-tis --tis-level geometric
 --sglang-cuda-graph-bs 1 2 4 8 --attention-backend flash"""
DEEPSEEK_V3 = """--disable-bias-linear --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432
 --num-attention-heads 128 --kv-channels 128 --normalization RMSNorm --position-embedding-type rope
 --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --vocab-size 129280 --multi-latent-attention
 --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
 --rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0 --attention-softmax-in-fp32
 --num-experts 256 --moe-layer-freq [0,0,0,1,1] --moe-ffn-hidden-size 2048 --moe-router-topk 8
 --moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax --moe-router-score-function sigmoid
 --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
 --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 --moe-router-group-topk 4 --moe-router-num-groups 8
 --moe-grouped-gemm --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --moe-permute-fusion"""


@pytest.mark.parametrize("line", [QWEN3_30B_A3B, DEEPSEEK_V3], ids=["qwen3-30B-A3B", "deepseek-v3"])
def test_a_moe_line_gets_one_refusal_naming_its_moe_flags(line):
    with pytest.raises(ValueError) as err:
        parse_args_to_config("27b", line.split())
    message = str(err.value)
    assert message.startswith("--num-experts is a Megatron-LM flag this trainer cannot honour: mixture-of-experts "
                              "models are not supported (dense GPT only); this command line describes a "
                              "mixture-of-experts model")
    assert "cannot be used; change each of them" not in message and "\n" not in message
    assert "--moe-router-topk" in message and "--moe-grouped-gemm" in message
    assert "--hf-checkpoint" not in message and "unknown option" not in message


def test_one_moe_flag_is_enough_and_a_dense_line_is_not_one():
    with pytest.raises(ValueError, match=r"^--moe-router-topk is a Megatron-LM flag .* mixture-of-experts"):
        parse_args_to_config("tiny", ["--moe-router-topk", "8"])
    assert parse_args_to_config("tiny", ["--expert-model-parallel-size", "1"]).parallel.tp == 1

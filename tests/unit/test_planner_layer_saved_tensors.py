"""The planner's per-layer activation term against what autograd saves in a real megatron-core layer.

One ``TransformerLayer`` of the local spec (what ``build_gpt`` builds) runs forward under
``saved_tensors_hooks``; the unique storages it saves (parameters excluded, the layer input included:
a LayerNorm saves it) must equal ``layer_activations(...).total`` exactly, for MHA and GQA, with and
without Qwen3's q/k norms, RMSNorm (fp32 weights) and LayerNorm, SwiGLU and GELU, RoPE and learned
positions, dense AdamW and LoGRA (all four targets, a subset, a subset with frozen non-targets).

The one device-dependent detail: CUDA's ``layer_norm`` keeps its mean and rstd in fp32, which the
planner plans, while the CPU kernel keeps them in the input's dtype; the test measures that dtype and
corrects the LayerNorm statistics by the difference.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_logra.memory.activations import activation_bytes, layer_activations
from megatron_logra.memory.count import TARGET_KINDS, count_params
from megatron_logra.models.gpt import ModelConfig

B_SEQ, SEQ, HIDDEN, HEADS, FFN, RANK = 2, 32, 64, 4, 96, 8
OPTIMIZERS = {  # name: (targets, freeze_native)
    "dense": ((), False),
    "logra": (TARGET_KINDS, False),
    "logra-subset": (("linear_proj", "linear_fc1"), False),
    "logra-subset-frozen-native": (("linear_proj", "linear_fc1"), True),
}


def _saved_bytes(model: ModelConfig, groups, targets, freeze_native: bool) -> int:
    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.sketch.capture import install_sketches

    gpt = build_gpt(model, groups, seed=1)
    if targets:
        install_sketches(gpt, targets=targets, rank=RANK, seed=0)
    if freeze_native:
        for p in gpt.parameters():
            p.requires_grad_(False)
    layer = gpt.decoder.layers[0]
    params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    x = torch.randn(SEQ, B_SEQ, HIDDEN, dtype=model.torch_dtype, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    rotary = gpt.rotary_pos_emb(SEQ) if model.position_embedding_type == "rope" else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, rotary_pos_emb=rotary)
    return sum(saved.values())


def _layer_norm_stat_bytes() -> int:
    """Bytes per element of the mean / rstd this device's ``layer_norm`` keeps for a bf16 input."""
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    return torch.native_layer_norm(x, [8], None, None, 1e-5)[1].element_size()


@pytest.mark.parametrize("query_groups, qk_layernorm, normalization, swiglu",
                         list(itertools.product((None, 2), (False, True), ("RMSNorm", "LayerNorm"), (True, False))))
def test_layer_activations_equal_what_a_megatron_layer_saves(groups, one_thread, query_groups, qk_layernorm,
                                                             normalization, swiglu):
    T = B_SEQ * SEQ
    stat_gap = 4 - _layer_norm_stat_bytes()  # per statistic per row (planned fp32; 2 on CPU)
    for position, (name, (targets, freeze)) in itertools.product(("rope", "learned_absolute"), OPTIMIZERS.items()):
        model = ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=query_groups,
                            ffn_hidden_size=FFN, vocab_size=64, seq_length=SEQ, params_dtype="bfloat16", swiglu=swiglu,
                            qk_layernorm=qk_layernorm, normalization=normalization, position_embedding_type=position)
        planned = layer_activations(model, tp=1, micro_batch=B_SEQ, seq_len=SEQ, rank=RANK if targets else 0,
                                    targets=targets, freeze_native=freeze)
        if normalization == "LayerNorm":
            rows = 2 * T + (T * (HEADS + (query_groups or HEADS)) if qk_layernorm else 0)
            expected = planned.total - 2 * stat_gap * rows
        else:
            expected = planned.total
        measured = _saved_bytes(model, groups, targets, freeze)
        assert measured == expected, (position, name, measured, expected, planned)


def test_frozen_targets_save_no_inputs():
    """LoGRA's default targets drop the norm outputs, the proj input and the fc2 input (megatron's
    ``linear_with_frozen_weight`` saves only the weight) and add the captured ``P``; frozen non-targets
    also drop the fp32 normalised inputs of the RMSNorms."""
    model = ModelConfig(num_layers=2, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=5440,
                        vocab_size=32000, seq_length=2048, params_dtype="bfloat16")
    b, s, h, q, f, r = 2, 2048, 2048, 2048, 5440, 128
    T = b * s
    dense = layer_activations(model, tp=1, micro_batch=b, seq_len=s)
    logra = layer_activations(model, tp=1, micro_batch=b, seq_len=s, rank=r, targets=TARGET_KINDS)
    frozen = layer_activations(model, tp=1, micro_batch=b, seq_len=s, rank=r, targets=TARGET_KINDS,
                               freeze_native=True)
    assert dense.total - logra.total == 2 * (2 * T * h) + 2 * T * q + 2 * T * f - 4 * 2 * T * r
    assert logra.total - frozen.total == 2 * (4 * T * h)
    # MHA: v is a view of the fused QKV output, which therefore stays saved besides q and k
    assert dense.attention == 5 * 2 * T * q + 6 * 32 * T * s


@pytest.mark.parametrize("freeze_native, output_target", [(False, False), (True, False), (False, True)])
def test_the_output_layer_input_is_saved_only_when_it_trains(freeze_native, output_target):
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192, vocab_size=64,
                        seq_length=32, params_dtype="bfloat16")
    targets = TARGET_KINDS + (("output_layer",) if output_target else ())
    counts = count_params(model, targets=targets)
    T, h, r = 2 * 32, 64, 8
    kwargs = dict(tp=1, pp=1, micro_batch=2, seq_len=32, rank=r, freeze_native=freeze_native)
    with_targets = activation_bytes(model, counts, targets=targets, **kwargs)
    layers_only = activation_bytes(model, counts, targets=TARGET_KINDS, **kwargs)
    final_norm_trained = 4 * T * h + 4 * T + 4 * T * h
    final_norm_frozen = 4 * T * h + 4 * T
    if output_target:
        # the output layer is frozen (no input saved) and captures P
        assert with_targets - layers_only == 2 * T * r - 2 * T * h
    elif freeze_native:
        stage_extra = with_targets - 2 * layer_activations(model, tp=1, micro_batch=2, seq_len=32, rank=r,
                                                           targets=TARGET_KINDS, freeze_native=True).total
        assert stage_extra - (2 + 6) * 4 * T * 32 == final_norm_frozen
    else:
        stage_extra = with_targets - 2 * layer_activations(model, tp=1, micro_batch=2, seq_len=32, rank=r,
                                                           targets=TARGET_KINDS).total
        assert stage_extra - (2 + 6) * 4 * T * 32 == final_norm_trained + 2 * T * h

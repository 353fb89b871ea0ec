"""megatron-core GPT builder with Llama/Qwen-style options and layout-invariant init.

The model's section, :class:`~megatron_logra.models.config.ModelConfig`, lives in
:mod:`megatron_logra.models.config` and is importable from here; the layout-invariant initialisation
(``init_layout_invariant_``: values that depend only on the seed and a parameter's *global* name, never on
TP/PP layout, so runs at different parallel layouts start from identical weights) in
:mod:`megatron_logra.models.weights`. This module turns a config into megatron-core's ``TransformerConfig``
and ``GPTModel`` and masks the padded vocabulary.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from megatron_logra.models.config import ModelConfig
from megatron_logra.models.te import decoder_spec, fp8_config_kwargs, resolve_transformer_impl
from megatron_logra.models.weights import init_layout_invariant_, set_skipped_tp_attributes
from megatron_logra.parallel import ParallelGroups

logger = logging.getLogger(__name__)

__all__ = ["ModelConfig", "build_gpt", "mask_padded_vocab", "PADDED_LOGIT"]


def _transformer_config(cfg: ModelConfig, groups: ParallelGroups, impl: Optional[str] = None,
                        initialize: bool = True):
    """megatron ``TransformerConfig`` of ``cfg``; ``impl=None`` gives the shapes only (no FP8, no
    sequence parallelism: what the memory planner counts on the meta device)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    sequence_parallel = impl is not None and cfg.sequence_parallel and groups.tp_size > 1
    if sequence_parallel and impl != "transformer_engine":
        raise RuntimeError(f"model.sequence_parallel=true needs the TransformerEngine spec, but "
                           f"model.transformer_impl={cfg.transformer_impl!r} resolved to {impl!r} on this machine")

    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        params_dtype=cfg.torch_dtype,
        bf16=cfg.torch_dtype == torch.bfloat16,
        fp16=cfg.torch_dtype == torch.float16,
        pipeline_dtype=cfg.torch_dtype,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        init_method_std=cfg.init_std,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.layernorm_epsilon,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        gated_linear_unit=cfg.swiglu,
        activation_func=torch.nn.functional.silu if cfg.swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        qk_layernorm=cfg.qk_layernorm,
        sequence_parallel=sequence_parallel,
        calculate_per_token_loss=True,
        **(fp8_config_kwargs(cfg.fp8, cfg.fp8_recipe, impl) if impl is not None else {}),
    )
    if cfg.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**kwargs)


def build_gpt(cfg: ModelConfig, groups: ParallelGroups, *, seed: int = 1234, initialize: bool = True) -> nn.Module:
    """Build this rank's stage of a megatron-core ``GPTModel`` and initialise it layout-invariantly.

    ``initialize=False`` is for a model whose every weight is loaded next (a Hugging Face
    checkpoint, a resumed checkpoint, another model's state): the weights are zeros instead of
    random draws. At 27B the two random initialisations (megatron's full-size CPU draw per
    weight, then the layout-invariant one) cost minutes and ~18 GB of host memory per rank,
    all of it overwritten by the load.
    Parallel state must have been initialised by :func:`megatron_logra.parallel.initialize_parallel`.
    ``cfg.transformer_impl`` picks the layer spec (``auto`` resolves here); a TransformerEngine
    model is moved to the current CUDA device (TE runs on GPUs only); so is a local one whenever a
    GPU is present (``forward_backward`` moves micro-batches to the model's device).
    """
    from megatron.core.models.gpt import GPTModel

    impl = resolve_transformer_impl(cfg.transformer_impl)
    tcfg = _transformer_config(cfg, groups, impl, initialize=initialize)
    spec = decoder_spec(impl, tcfg, normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.padded_vocab_size(groups.tp_size),
        max_sequence_length=cfg.seq_length,
        pre_process=groups.pp_first,
        post_process=groups.pp_last,
        parallel_output=True,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor if cfg.rope_scaling_factor is not None else 8.0,
    )
    if impl == "local" and cfg.torch_dtype != torch.float32:
        # megatron's local spec builds torch.nn.LayerNorm without a dtype (fp32 beside 16-bit linears);
        # CUDA's layer_norm kernel wants weights in the input's dtype, as apex's fused norm has them
        for module in model.modules():
            if type(module) is torch.nn.LayerNorm:
                module.to(cfg.torch_dtype)
    if initialize:
        init_layout_invariant_(model, cfg, groups, seed=seed)
    else:
        set_skipped_tp_attributes(model)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    if impl == "transformer_engine" or torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    padded = cfg.padded_vocab_size(groups.tp_size)
    if groups.pp_last and padded > cfg.vocab_size:
        mask_padded_vocab(model.output_layer, cfg.vocab_size, first_col=groups.tp_rank * (padded // groups.tp_size))
    return model


PADDED_LOGIT = -1.0e4
"""Logit of padded vocabulary columns: never sampled, ~0 probability, finite (KL terms stay finite)."""


def mask_padded_vocab(module: nn.Module, vocab_size: int, *, first_col: int = 0):
    """Set this output layer's logits for global columns ``>= vocab_size`` to :data:`PADDED_LOGIT`.

    Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by · TP``; rows of a
    real checkpoint are zero there, so their logits would be 0 and carry probability. The trainer
    (megatron ``output_layer``, a vocab shard starting at ``first_col``) and the rollout engine
    (HF ``lm_head``) both install this, so sampling, log-probs and the KL probe see one distribution.
    Returns the hook handle.
    """

    def hook(_module, _args, output):
        logits = output[0] if isinstance(output, tuple) else output
        local = logits.shape[-1]
        start = max(0, vocab_size - first_col)
        if start >= local:
            return output
        pad = torch.zeros(local, dtype=torch.bool, device=logits.device)
        pad[start:] = True
        masked = logits.masked_fill(pad, PADDED_LOGIT)
        return (masked,) + tuple(output[1:]) if isinstance(output, tuple) else masked

    return module.register_forward_hook(hook)

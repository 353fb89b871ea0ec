"""megatron-core GPT builder with Llama/Qwen-style options and layout-invariant init.

``init_layout_invariant_`` gives every parameter values that depend only on the seed and
the parameter's *global* name, never on TP/PP layout, so runs at different parallel
layouts start from identical weights (the basis of the TP/PP/DP equivalence tests).
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megatron_logra.models.layout import global_param_names, shard_full
from megatron_logra.models.te import check_model_fields, decoder_spec, fp8_config_kwargs, resolve_transformer_impl
from megatron_logra.parallel import ParallelGroups

logger = logging.getLogger(__name__)

__all__ = ["ModelConfig", "build_gpt", "init_layout_invariant_", "set_skipped_tp_attributes", "weight_source_name"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_positive(name: str, value: float, example: str) -> None:
    """``value`` must be a finite number > 0; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0 ({example})")


@dataclass
class ModelConfig:
    """Shape and options of a decoder-only GPT (megatron-core ``GPTModel``)."""

    num_layers: int = 2
    """Transformer layers (Megatron-LM: --num-layers)."""
    hidden_size: int = 64
    """Model width (--hidden-size)."""
    num_attention_heads: int = 4
    """Query heads (--num-attention-heads)."""
    num_query_groups: Optional[int] = None
    """KV heads for grouped-query attention; None = multi-head (--num-query-groups)."""
    kv_channels: Optional[int] = None
    """Head dimension; None = hidden_size / num_attention_heads (--kv-channels; Qwen3 and Gemma
    models set HF ``head_dim`` to something else)."""
    ffn_hidden_size: int = 192
    """MLP width (--ffn-hidden-size)."""
    vocab_size: int = 64
    """Tokenizer vocabulary; padded to a multiple of ``make_vocab_size_divisible_by × tp``."""
    make_vocab_size_divisible_by: int = 16
    """Vocabulary padding multiple, >= 1 (--make-vocab-size-divisible-by)."""
    seq_length: int = 64
    """Maximum sequence length (--seq-length; --max-position-embeddings is only checked against it)."""
    swiglu: bool = True
    """Gated SiLU MLP (Llama/Qwen); False = GELU MLP."""
    normalization: str = "RMSNorm"
    """RMSNorm or LayerNorm."""
    position_embedding_type: str = "rope"
    """rope or learned_absolute."""
    rotary_base: int = 10000
    """RoPE base theta, > 0 (--rotary-base)."""
    rope_scaling_factor: Optional[float] = None
    """Llama 3.x RoPE scaling factor, > 0 (megatron-core's ``rope_scaling`` with Llama 3's low/high frequency
    factors 1 and 4 and original context 8192; Hugging Face ``rope_type: llama3``; read from ``model.hf_path``);
    null: unscaled RoPE. ``--rope-scaling-factor F`` sets it (unlike Megatron-LM it needs no
    ``--use-rope-scaling``, which alone sets Megatron-LM's default 8)."""
    add_bias_linear: bool = False
    """Biases on all linears (--add-bias-linear)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate output layer (--untie-embeddings-and-output-weights)."""
    params_dtype: str = "float32"
    """Weight dtype: float32, bfloat16 or float16."""
    recompute: str = "none"
    """Activation recompute: none or full (--recompute-granularity full, uniform, 1 layer)."""
    hidden_dropout: float = 0.0
    """Dropout after attention/MLP, in [0, 1) (--hidden-dropout)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities, in [0, 1) (--attention-dropout)."""
    init_std: float = 0.02
    """Std of the normal init, > 0 (--init-method-std)."""
    layernorm_epsilon: float = 1e-6
    """Norm epsilon, > 0 (--norm-epsilon)."""
    transformer_impl: str = "local"
    """Layer implementation: ``local`` (megatron-core local spec, CPU and GPU), ``transformer_engine``
    (TE spec: fused norm+linear, TE attention, FP8, sequence parallelism; needs CUDA and the ``gpu``
    extra) or ``auto`` (TE when installed with CUDA, else local). See ``megatron_logra.models.te``."""
    fp8: Optional[str] = None
    """FP8 GEMMs in the transformer layers: null (off), ``hybrid`` (E4M3 forward, E5M2 gradients) or
    ``e4m3``; needs the TE spec (megatron ``--fp8-format``). Each rank's token count per micro-batch
    must be a multiple of 16 (32 with ``fp8_recipe=mxfp8``): RL pads sequences to
    ``models.te.sequence_multiple`` (so ``seq_length`` must be a multiple of it), the lm job checks its
    micro-batch shape."""
    fp8_recipe: str = "delayed"
    """TE scaling recipe when ``fp8`` is set: delayed, tensorwise, blockwise (Hopper) or mxfp8 (Blackwell)."""
    sequence_parallel: bool = False
    """Shard norms, dropout and residuals along the sequence over the TP group (--sequence-parallel);
    needs the TE spec and only takes effect with parallel.tp > 1. Sketches gather ``X·Aᵀ``, never ``X``."""
    hf_path: str = ""
    """Hugging Face checkpoint directory (config.json + safetensors) to start from; "" = random init.
    Its architecture fields replace this config's (``megatron_logra.convert.model_config_from_hf``) and its
    weights are loaded into the built model at any TP/PP (``megatron_logra.convert.load_hf_into_model``)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"model.make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1 "
                             f"(the vocabulary padding multiple; 1 pads nothing)")
        if self.num_query_groups is not None and (not isinstance(self.num_query_groups, int) or self.num_query_groups < 1):
            raise ValueError(f"model.num_query_groups={self.num_query_groups!r} must be a positive integer that divides "
                             f"model.num_attention_heads (or null for multi-head attention)")
        # NaN and ±inf pass every ``<`` comparison: check finiteness first. Each of these values otherwise
        # reaches the first forward as a NaN loss (rotary_base <= 0, layernorm_epsilon < 0) or a torch error
        _check_positive("model.rotary_base", self.rotary_base, "the RoPE base theta, e.g. 10000")
        if self.rope_scaling_factor is not None:
            _check_positive("model.rope_scaling_factor", self.rope_scaling_factor,
                            "Llama 3.1's 8.0, or null for unscaled RoPE")
            if self.position_embedding_type != "rope":
                raise ValueError(f"model.rope_scaling_factor={self.rope_scaling_factor} scales RoPE, but "
                                 f"model.position_embedding_type={self.position_embedding_type!r}; set it to null")
        _check_positive("model.layernorm_epsilon", self.layernorm_epsilon, "e.g. 1e-6 for RMSNorm, 1e-5 for LayerNorm")
        # std 0 initialises every weight to zero: every gradient is zero then and the model never trains
        _check_positive("model.init_std", self.init_std, "e.g. 0.02")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value < 1.0):
                raise ValueError(f"model.{name}={value} must be a dropout probability in [0, 1) (0 disables dropout)")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int) or self.kv_channels < 1):
            raise ValueError(f"model.kv_channels={self.kv_channels!r} must be a positive integer (or null for "
                             "hidden_size / num_attention_heads)")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by model.num_attention_heads="
                f"{self.num_attention_heads}, or set model.kv_channels (the head dimension)"
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(f"model.num_query_groups={groups} must divide num_attention_heads={self.num_attention_heads}")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"model.normalization={self.normalization!r}: choose RMSNorm or LayerNorm")
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            raise ValueError(f"model.position_embedding_type={self.position_embedding_type!r}: choose rope or learned_absolute")
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"model.params_dtype={self.params_dtype!r}: choose one of {sorted(_DTYPES)}")
        if self.recompute not in ("none", "full"):
            raise ValueError(f"model.recompute={self.recompute!r}: choose none or full")
        check_model_fields(self.transformer_impl, self.fp8, self.fp8_recipe, self.sequence_parallel)
        if not isinstance(self.hf_path, str):
            raise ValueError(f"model.hf_path={self.hf_path!r} must be a directory path (a string)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_params(self) -> int:
        """Total parameter count (padded vocabulary at TP=1)."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.padded_vocab_size()
        q = self.num_attention_heads * self.head_dim
        kv = (self.num_query_groups or self.num_attention_heads) * self.head_dim
        attn = h * (q + 2 * kv) + q * h
        mlp = h * f * (3 if self.swiglu else 2)
        per_layer = attn + mlp + 2 * h
        emb = v * h * (2 if self.untie_embeddings_and_output_weights else 1)
        return self.num_layers * per_layer + emb + h


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


def set_skipped_tp_attributes(model: nn.Module) -> None:
    """Mark the TP-split weights of megatron-core's own layers as its initialisers would have.

    megatron-core sets ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` on a
    ``ColumnParallelLinear``, ``RowParallelLinear`` or ``VocabParallelEmbedding`` weight only inside
    its initialisers, which ``perform_initialization=False`` skips; without them every gather,
    checkpoint load and refit would take the TP shards for replicated tensors. Column-parallel
    weights split rows (``linear_fc1`` of a gated MLP with stride 2: each rank holds its
    [gate; up] slice, as megatron's MLP builds it), row-parallel weights split columns, the
    vocabulary embedding splits rows. TransformerEngine layers set theirs in any case and are
    left alone, as is any weight that already carries them.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    config = getattr(model, "config", None)
    gated = bool(getattr(config, "gated_linear_unit", False)) and not getattr(config, "use_kitchen", False)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, VocabParallelEmbedding):
            dim, stride = 0, 1
        elif isinstance(module, ColumnParallelLinear):
            dim, stride = 0, (2 if gated and name.rsplit(".", 1)[-1] == "linear_fc1" else 1)
        elif isinstance(module, RowParallelLinear):
            dim, stride = 1, 1
        else:
            continue
        set_tensor_model_parallel_attributes(weight, True, dim, stride)


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


WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"


def weight_source_name(model: nn.Module, global_name: str) -> str:
    """The global name whose values parameter ``global_name`` of ``model`` must hold.

    With tied embeddings (``untie_embeddings_and_output_weights=False``) and PP > 1, megatron keeps a
    copy of the word embeddings on the last stage as ``output_layer.weight``; that copy must always
    equal the first stage's ``embedding.word_embeddings.weight`` (megatron-core's
    ``setup_embeddings_and_output_layer`` copies it at build, the native optimizer sums the two
    copies' gradients over the embedding group). Every initialisation and every load fills it from
    :data:`WORD_EMBEDDINGS`; every other parameter (and an untied output layer) is its own source.
    At PP = 1 a tied model has no ``output_layer.weight`` parameter at all.
    """
    if global_name == OUTPUT_WEIGHT and getattr(model, "share_embeddings_and_output_weights", False):
        return WORD_EMBEDDINGS
    return global_name


def _param_seed(seed: int, global_name: str) -> int:
    digest = hashlib.blake2b(f"logra-init|{seed}|{global_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_layout_invariant_(model: nn.Module, cfg: ModelConfig, groups: ParallelGroups, *, seed: int = 1234) -> None:
    """Re-initialise every parameter from ``(seed, global name)`` and take this rank's TP shard.

    Norm weights -> 1, biases -> 0, matrices -> N(0, init_std²) (output projections scaled by
    1/sqrt(2·num_layers) as in Megatron). The padded vocabulary rows are generated at the
    padded size of TP=1 ... so they are also identical across TP, except for extra padding.

    The last stage's copy of tied word embeddings (PP > 1) is drawn as the word embeddings
    themselves (:func:`weight_source_name`), so it equals the first stage's values bit for bit,
    as megatron-core's own build leaves it, without a collective: a tied model at PP = 2 starts
    exactly as the same model at PP = 1.
    """
    names = global_param_names(model)
    for local_name, param in model.named_parameters():
        gname = weight_source_name(model, names[local_name])
        leaf = gname.split(".")[-1]
        if "norm" in gname.split(".")[-2] or gname.endswith("layer_norm_weight"):
            param.fill_(1.0)
            continue
        if leaf == "bias" or gname.endswith("layer_norm_bias"):
            param.zero_()
            continue
        full_shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            full_shape[param.partition_dim] *= groups.tp_size
        std = cfg.init_std
        if gname.endswith(("linear_proj.weight", "linear_fc2.weight")):
            std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
        gen = torch.Generator().manual_seed(_param_seed(seed, gname))
        full = torch.randn(full_shape, generator=gen, dtype=torch.float32) * std
        param.copy_(shard_full(full, gname, param, groups.tp_rank, groups.tp_size))

"""The ``model`` section: :class:`ModelConfig`, the shape and options of a decoder-only GPT.

Plain data, checked when constructed (every value that would otherwise reach the first forward as a NaN loss
or a torch error is refused here, naming the field); building the model from it is
:func:`megatron_logra.models.gpt.build_gpt`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_logra.models.te import check_model_fields

__all__ = ["ModelConfig"]

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
        if self.recompute == "selective":
            raise ValueError("model.recompute='selective' (--recompute-granularity selective): selective recompute "
                             "of the attention core is not supported; choose full (model.recompute=full, "
                             "--recompute-granularity full: every layer's activations recomputed) or none")
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

"""What a conversion moves where: strict HF config checks and the per-tensor megatron plan.

:func:`check_hf_config` accepts a ``config.json`` of a dense Llama / Mistral / Qwen2 / Qwen3
causal LM whose forward pass megatron-core's GPT reproduces, and rejects everything else with
a ``ValueError`` naming the field: other architectures, rope scaling other than Llama 3's (``rope_type:
llama3`` with megatron-core's constants, ``model.rope_scaling_factor``), partial rotary, sliding-window attention (decided per family
as transformers decides it, see :func:`check_hf_config`), mixture-of-experts fields,
quantized checkpoints, non-SiLU MLPs, and values of the wrong type (null, a string for a number or
boolean). A ``head_dim`` other than hidden/heads is supported (``model.kv_channels``); the RoPE base is
the one transformers uses (``rope_parameters.rope_theta`` before a top-level ``rope_theta``).

:func:`megatron_plan` lists every tensor of the megatron model at a ``(tp, pp)`` layout: its
global name (TP=1 layout, global layer index), the HF tensors it is made of and how
(``copy``, ``qkv`` fuse, ``fc1`` = ``[gate; up]``, ``vocab`` = rows padded with zeros to the
padded vocabulary), its TP partition ``(dim, stride)`` (megatron-core's
``partition_dim`` / ``partition_stride``), its pipeline stage and its stage-local name, i.e.
exactly what ``build_gpt`` holds on rank ``(tp_rank, pp_rank)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional, Union

import torch

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.models.hf import _check_supported, hf_shapes, hf_sources, megatron_shapes
from megatron_logra.models.layout import shard_full
from megatron_logra.models.presets import (_family, _require, hf_bool, hf_rope_scaling_factor, hf_rope_theta,
                                          model_config_from_hf_dict, read_json_object)

logger = logging.getLogger(__name__)

__all__ = ["check_hf_config", "model_config_from_hf_dict_strict", "model_config_from_hf", "TensorPlan",
           "megatron_plan", "partition_of", "check_layout", "hf_expected_shapes", "shard", "shard_shape",
           "build_full", "split_to_hf", "place_shard",
           "ARCH_FIELDS", "TRAINING_FIELDS", "IGNORED_HF_SUFFIXES", "check_same_architecture"]

TRAINING_FIELDS = ("seq_length", "params_dtype", "recompute", "hidden_dropout", "attention_dropout", "init_std",
                   "make_vocab_size_divisible_by", "hf_path",
                   "transformer_impl", "fp8", "fp8_recipe", "sequence_parallel")
"""ModelConfig fields a run chooses; everything else (:data:`ARCH_FIELDS`) comes from the HF config."""
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in TRAINING_FIELDS)

IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)
"""HF tensors that are recomputed buffers, not weights (older Llama checkpoints store them)."""

_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")


def check_hf_config(raw: dict, source: str = "config.json", seq_length: Optional[int] = None) -> None:
    """Reject HF config fields whose model the megatron GPT would not reproduce (``ValueError`` naming the field).

    The architecture is checked first, so an unsupported family (Gemma, say) is named as such rather
    than by one of its fields. Sliding-window attention is refused exactly when transformers would run
    some layer with a window that a sequence of ``seq_length`` tokens (the run's ``model.seq_length``;
    None: unknown) can exceed (:func:`_check_full_attention`)."""
    family = _family(raw, source)
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"{source}: {key}={rope!r} is not supported (expected an object)")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"{source}: {key}.rope_type={kind!r} is not supported: the megatron model implements "
                             "unscaled (default) and Llama 3 (llama3) RoPE")
        factor = rope.get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            raise ValueError(f"{source}: {key}.partial_rotary_factor={factor} is not supported (rotary on all dims only)")
    if raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor={raw['partial_rotary_factor']} is not supported")
    hf_rope_scaling_factor(raw, source)  # llama3: exactly the constants megatron implements
    theta = hf_rope_theta(raw, source, warn=False)  # transformers' choice between rope_parameters and rope_theta
    if theta != int(theta):
        raise ValueError(f"{source}: RoPE theta {theta!r} is not supported (model.rotary_base is a positive integer)")
    _check_full_attention(raw, family, source, seq_length)
    for key in _MOE_FIELDS:
        if raw.get(key):
            raise ValueError(f"{source}: {key}={raw[key]} (mixture of experts) is not supported: dense models only")
    if raw.get("quantization_config"):
        raise ValueError(f"{source}: quantization_config is set: quantized checkpoints are not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key):
            raise ValueError(f"{source}: {key}={raw[key]} is not supported")


_HF_SLIDING_WINDOW_DEFAULT = 4096
"""``sliding_window`` of ``MistralConfig`` / ``Qwen2Config`` / ``Qwen3Config`` when the key is missing."""
_HF_MAX_WINDOW_LAYERS_DEFAULT = 28
"""``max_window_layers`` of ``Qwen2Config`` / ``Qwen3Config`` when the key is missing."""


def _within_window(window: Any, seq_length: Optional[int]) -> bool:
    """Whether a ``window``-token sliding window masks nothing in sequences of at most ``seq_length`` tokens
    (transformers lets query ``i`` see key ``j`` when ``i - j < window``; the largest distance is
    ``seq_length - 1``), so the model equals its full-attention self there."""
    return (seq_length is not None and isinstance(window, int) and not isinstance(window, bool)
            and 0 < seq_length <= window)


def _check_full_attention(raw: dict, family: str, source: str, seq_length: Optional[int] = None) -> None:
    """``ValueError`` unless transformers runs every layer of this config with full (unwindowed) attention, or
    with a window no sequence of ``seq_length`` tokens (the run's ``model.seq_length``) exceeds: then the
    windowed and the full model are the same function, and the config is accepted with an info line (the
    rollout engine, SGLang included, and an export keep the config's window).

    Decided per family as transformers 5 does (``configuration_*.py`` / ``modeling_*.py``):

    - ``mistral``: ``MistralConfig`` has no ``use_sliding_window`` switch and its ``sliding_window``
      defaults to 4096 when the key is missing; ``MistralForCausalLM`` applies it to every layer. Only
      an explicit ``"sliding_window": null`` is full attention.
    - ``qwen2`` / ``qwen3``: ``sliding_window`` counts only with ``use_sliding_window: true`` (default
      false), and then only for the layers ``i >= max_window_layers`` (default 28) unless ``layer_types``
      lists the layers explicitly; ``max_window_layers >= num_hidden_layers`` is full attention.
    - ``llama``: the model has no sliding-window attention; stray ``sliding_window`` /
      ``use_sliding_window`` / ``max_window_layers`` keys are ignored, as transformers ignores them
      (logged as a warning).

    For every family ``use_sliding_window`` must be a JSON boolean when present, and an explicit
    ``layer_types`` naming anything but ``full_attention`` is refused.
    """
    use = hf_bool(raw, "use_sliding_window", False, source)
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ValueError(f"{source}: layer_types={layer_types!r} must be a list of layer types")
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            raise ValueError(f"{source}: layer_types contains {other}; only full_attention layers are supported")
    if family == "llama":
        stray = [f"{k}={raw[k]!r}" for k in ("sliding_window", "use_sliding_window", "max_window_layers")
                 if raw.get(k) not in (None, False)]
        if stray:
            logger.warning("%s: %s ignored: a Llama model has no sliding-window attention (transformers' "
                           "LlamaForCausalLM ignores these keys too); every layer uses full attention",
                           source, ", ".join(stray))
        return
    if family == "mistral":
        window = raw.get("sliding_window", _HF_SLIDING_WINDOW_DEFAULT)
        if _within_window(window, seq_length):
            logger.info("%s: sliding_window=%d >= model.seq_length=%d: no sequence reaches past the window, so full "
                        "attention computes the same model", source, window, seq_length)
            return
        if window is not None:
            missing = " (the key is missing: MistralConfig's default)" if "sliding_window" not in raw else ""
            ignored = (", whatever use_sliding_window says (MistralConfig has no such switch)"
                       if "use_sliding_window" in raw else "")
            raise ValueError(f"{source}: sliding_window={window}{missing} is not supported (full attention only): "
                             f"transformers' MistralForCausalLM applies it to every layer{ignored}; a Mistral "
                             'config with "sliding_window": null (full attention) is loaded, and so is this one '
                             f"for a run whose model.seq_length is at most {window} (no sequence reaches past "
                             f"the window){_seq_note(seq_length)}")
        return
    # qwen2 / qwen3
    window = raw.get("sliding_window", _HF_SLIDING_WINDOW_DEFAULT)
    if not use or window is None or layer_types is not None:
        return
    first = raw.get("max_window_layers", _HF_MAX_WINDOW_LAYERS_DEFAULT)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ValueError(f"{source}: max_window_layers={first!r} must be a non-negative integer")
    layers = _require(raw, "num_hidden_layers", source)
    if first < layers and _within_window(window, seq_length):
        logger.info("%s: sliding_window=%d of layers %d..%d >= model.seq_length=%d: no sequence reaches past the "
                    "window, so full attention computes the same model", source, window, first, layers - 1, seq_length)
    elif first < layers:
        raise ValueError(f"{source}: use_sliding_window=True with sliding_window={window} and "
                         f"max_window_layers={first} gives layers {first}..{layers - 1} a sliding window, which is not supported (full "
                         f"attention only; max_window_layers >= num_hidden_layers={layers} or "
                         f"use_sliding_window=false would be full attention, and a run whose model.seq_length is at "
                         f"most {window} computes the same model{_seq_note(seq_length)})")


def _seq_note(seq_length: Optional[int]) -> str:
    return "" if seq_length is None else f"; this one has model.seq_length={seq_length}"


def model_config_from_hf_dict_strict(raw: dict, *, source: str = "config.json", base: Optional[ModelConfig] = None,
                                     seq_length: Optional[int] = None) -> ModelConfig:
    """:func:`check_hf_config`, then the presets loader, then the HF-mapping support check.

    Architecture fields come from ``raw``; :data:`TRAINING_FIELDS` from ``base`` when given
    (else ``seq_length`` = ``max_position_embeddings``, dtype from the config, ModelConfig defaults).
    """
    run_length = base.seq_length if base is not None else seq_length
    if run_length is None:  # the model's own context, as below
        mpe = raw.get("max_position_embeddings")
        run_length = mpe if isinstance(mpe, int) and not isinstance(mpe, bool) else None
    check_hf_config(raw, source, seq_length=run_length)
    if seq_length is None and base is None:
        mpe = raw.get("max_position_embeddings")
        if "max_position_embeddings" in raw and (not isinstance(mpe, int) or isinstance(mpe, bool) or mpe < 1):
            raise ValueError(f"{source}: max_position_embeddings={mpe!r} must be a positive integer")
        seq_length = mpe
    cfg = model_config_from_hf_dict(raw, seq_length=seq_length, source=source)
    if base is not None:
        cfg = replace(cfg, **{k: getattr(base, k) for k in TRAINING_FIELDS})
    try:
        _check_supported(cfg)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return cfg


def read_hf_config(hf_dir: Union[str, Path]) -> tuple[dict, Path]:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ValueError(f"{hf_dir}: not a directory (expected a Hugging Face checkpoint directory)")
    if not path.is_file():
        raise ValueError(f"{hf_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    return read_json_object(path), path


def model_config_from_hf(hf_dir: Union[str, Path], base: Optional[ModelConfig] = None) -> ModelConfig:
    """``ModelConfig`` of the HF checkpoint in ``hf_dir`` (strictly checked, see :func:`check_hf_config`).

    Architecture fields (layers, widths, heads, groups, vocabulary, biases, q/k norm, tying, RoPE
    base, norm epsilon) come from ``config.json``. With ``base`` the run's own choices
    (:data:`TRAINING_FIELDS`: sequence length, dtype, recompute, dropout, init std, vocabulary
    padding multiple, layer implementation, FP8, sequence parallelism) are kept from it; without, ``seq_length`` is ``max_position_embeddings`` and
    the dtype is the checkpoint's. ``hf_path`` is set to ``hf_dir`` made absolute (against the working
    directory, symlinks kept), so a run's saved config names the checkpoint wherever it is resumed or exported.
    """
    if not str(hf_dir) or not Path(hf_dir).is_dir():
        raise ValueError(f"model.hf_path={str(hf_dir)!r} is not a directory (expected a Hugging Face checkpoint)")
    try:
        raw, path = read_hf_config(hf_dir)
    except ValueError as exc:
        raise ValueError(f"model.hf_path={str(hf_dir)!r}: {exc}") from None
    cfg = model_config_from_hf_dict_strict(raw, source=str(path), base=base)
    return replace(cfg, hf_path=os.path.abspath(hf_dir))


def check_same_architecture(cfg: ModelConfig, hf_cfg: ModelConfig, what: str) -> None:
    """``ValueError`` naming every architecture field where ``cfg`` differs from the checkpoint's ``hf_cfg``."""
    diff = [f"model.{k}={getattr(cfg, k)!r} but {what} has {getattr(hf_cfg, k)!r}"
            for k in ARCH_FIELDS if getattr(cfg, k) != getattr(hf_cfg, k)]
    if diff:
        raise ValueError("the model config does not match the checkpoint: " + "; ".join(diff))


def check_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    """``ValueError`` naming the field when ``cfg`` cannot be split at TP ``tp`` / PP ``pp``."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp={tp} and pp={pp} must be >= 1")
    groups = cfg.num_query_groups or cfg.num_attention_heads
    for field, hf_field, value in (("num_attention_heads", "num_attention_heads", cfg.num_attention_heads),
                                   ("num_query_groups", "num_key_value_heads", groups),
                                   ("ffn_hidden_size", "intermediate_size", cfg.ffn_hidden_size)):
        if value % tp:
            fits = [t for t in range(1, tp) if all(v % t == 0 for v in (cfg.num_attention_heads, groups,
                                                                        cfg.ffn_hidden_size))]
            raise ValueError(f"model.{field}={value} is not divisible by tp={tp} ({hf_field} in a Hugging Face "
                             "config.json; megatron-core splits heads, query groups and the MLP evenly over the TP "
                             f"ranks): use a TP size that divides it, e.g. tp={fits[-1]}")
    if cfg.num_layers % pp:
        fits = [q for q in range(1, pp) if cfg.num_layers % q == 0]
        raise ValueError(f"model.num_layers={cfg.num_layers} is not divisible by pp={pp} (num_hidden_layers in a "
                         f"Hugging Face config.json; every pipeline stage holds as many layers): use a PP size that "
                         f"divides it, e.g. pp={fits[-1]}")


def partition_of(global_name: str) -> Optional[tuple[int, int]]:
    """megatron-core's TP split ``(partition_dim, partition_stride)`` of a parameter, ``None`` if replicated."""
    leaf = global_name.rsplit(".", 1)[-1]
    if global_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0, 1
    if ".self_attention.linear_qkv." in global_name:
        return 0, 1
    if ".mlp.linear_fc1." in global_name:
        return 0, 2
    if leaf == "weight" and (".self_attention.linear_proj." in global_name or ".mlp.linear_fc2." in global_name):
        return 1, 1
    return None


def _fake_param(partition: Optional[tuple[int, int]]) -> SimpleNamespace:
    if partition is None:
        return SimpleNamespace(tensor_model_parallel=False)
    return SimpleNamespace(tensor_model_parallel=True, partition_dim=partition[0], partition_stride=partition[1])


def shard(full: torch.Tensor, partition: Optional[tuple[int, int]], tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of ``full`` (``layout.shard_full`` with the static partition).

    Stride 1 gives a view (no copy); stride > 1 concatenates the rank's blocks (one shard's worth).
    """
    if partition is not None and partition[1] == 1 and tp > 1:
        dim = partition[0]
        size = full.shape[dim] // tp
        return full.narrow(dim, tp_rank * size, size)
    return shard_full(full, "", _fake_param(partition), tp_rank, tp)


def shard_shape(shape: tuple[int, ...], partition: Optional[tuple[int, int]], tp: int) -> tuple[int, ...]:
    if partition is None or tp == 1:
        return tuple(shape)
    out = list(shape)
    out[partition[0]] //= tp
    return tuple(out)


@dataclass(frozen=True)
class TensorPlan:
    """One megatron parameter of one pipeline stage and the HF tensors it is made of."""

    name: str
    """Global megatron name (TP=1 layout, global layer index)."""
    local_name: str
    """Name in the stage's ``model.named_parameters()`` (stage-local layer index)."""
    pp_rank: int
    sources: tuple[str, ...]
    """HF tensor names, in combine order."""
    kind: str
    """copy | qkv | fc1 | vocab."""
    shape: tuple[int, ...]
    """Full (all TP ranks) shape, padded vocabulary of this layout."""
    partition: Optional[tuple[int, int]]


def hf_expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of ``cfg``'s checkpoint (unpadded vocabulary; no ``lm_head`` when tied)."""
    return hf_shapes(replace(cfg, make_vocab_size_divisible_by=1), tp=1)


def megatron_plan(cfg: ModelConfig, tp: int = 1, pp: int = 1) -> list[TensorPlan]:
    """Every parameter of ``build_gpt(cfg)`` at ``(tp, pp)``, stage by stage, in build order.

    With tied embeddings and ``pp > 1`` the last stage also holds ``output_layer.weight``,
    megatron-core's copy of the word embeddings (source ``model.embed_tokens.weight``).
    """
    check_layout(cfg, tp, pp)
    shapes = megatron_shapes(cfg, tp)
    per_stage = cfg.num_layers // pp
    out: list[TensorPlan] = []
    for name, shape in shapes.items():
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            stage, local = layer // per_stage, f"decoder.layers.{layer % per_stage}." + name.split(".", 3)[3]
        elif name == "embedding.word_embeddings.weight":
            stage, local = 0, name
        else:  # final_layernorm, output_layer
            stage, local = pp - 1, name
        sources = hf_sources(name)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            kind = "vocab"
        elif ".linear_qkv." in name:
            kind = "qkv"
        elif ".linear_fc1." in name:
            kind = "fc1"
        else:
            kind = "copy"
        out.append(TensorPlan(name, local, stage, sources, kind, tuple(shape), partition_of(name)))
    if not cfg.untie_embeddings_and_output_weights and pp > 1:
        emb = shapes["embedding.word_embeddings.weight"]
        out.append(TensorPlan("output_layer.weight", "output_layer.weight", pp - 1, ("model.embed_tokens.weight",),
                              "vocab", tuple(emb), partition_of("output_layer.weight")))
    out.sort(key=lambda t: t.pp_rank)  # stable: build order within a stage
    return out


def build_full(entry: TensorPlan, read: Callable[..., torch.Tensor], cfg: ModelConfig,
               dtype: torch.dtype) -> torch.Tensor:
    """The full megatron tensor of ``entry``, its HF parts read by ``read(name, out=...)`` into place.

    ``copy`` / ``fc1`` / ``vocab`` parts are read straight into their rows of the result (the padded
    vocabulary rows are zeros); ``qkv`` parts are read one at a time and copied into their per-group
    rows. Peak memory: the result plus one q/k/v part.
    """
    full = torch.empty(entry.shape, dtype=dtype)
    if entry.kind == "copy":
        read(entry.sources[0], out=full)
    elif entry.kind == "vocab":
        rows = cfg.vocab_size
        if rows > entry.shape[0]:
            raise ValueError(f"{entry.sources[0]} has {rows} rows, more than the padded vocabulary {entry.shape[0]}")
        read(entry.sources[0], out=full[:rows])
        full[rows:].zero_()
    elif entry.kind == "fc1":
        half = entry.shape[0] // 2
        read(entry.sources[0], out=full[:half])
        read(entry.sources[1], out=full[half:])
    elif entry.kind == "qkv":
        heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        d, per, rest = cfg.head_dim, heads // groups, tuple(entry.shape[1:])
        grouped = full.view(groups, per + 2, d, *rest)
        slots = (slice(0, per), slice(per, per + 1), slice(per + 1, per + 2))
        for name, slot in zip(entry.sources, slots):
            part = read(name)
            if part.dtype != dtype:
                raise ValueError(f"HF tensor {name} is {part.dtype}, the other parts of {entry.name} are {dtype}")
            grouped[:, slot].copy_(part.reshape(groups, slot.stop - slot.start, d, *rest))
            del part
    else:  # pragma: no cover - megatron_plan only makes the kinds above
        raise ValueError(f"unknown tensor kind {entry.kind!r}")
    return full


_SOURCE_SHIFT = 40  # row codes: (source index << 40) + row + 1; 0 marks a padded row


def build_shard(entry: TensorPlan, read: Callable[..., torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
                tp_rank: int, tp: int, source_rows: Callable[[str], int]) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of ``entry`` — equal to ``shard(build_full(...))`` — reading only
    the HF rows it holds when the tensor is split along its rows (QKV, ``fc1``, vocabulary: at
    TP = t each rank reads 1/t of those bytes). ``read(name, rows=(start, stop), out=...)`` reads a
    row range; ``source_rows(name)`` is an HF tensor's row count. Column-split and replicated
    tensors are built whole and sliced.

    Which HF rows land where is derived by running :func:`build_full` and :func:`shard` on row
    codes instead of values, so the layout logic exists once."""
    partition = entry.partition
    if partition is None or tp == 1 or partition[0] != 0:
        return shard(build_full(entry, read, cfg, dtype), partition, tp_rank, tp).contiguous()

    def code_read(name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = source_rows(name)
        codes = (torch.arange(n, dtype=torch.int64) + 1 + (entry.sources.index(name) << _SOURCE_SHIFT)).view(n, 1)
        if out is None:
            return codes
        return out.copy_(codes.view_as(out))

    codes = shard(build_full(replace(entry, shape=(entry.shape[0], 1)), code_read, cfg, torch.int64),
                  partition, tp_rank, tp).reshape(-1)
    out = torch.zeros((codes.numel(), *entry.shape[1:]), dtype=dtype)
    # runs of consecutive rows of one source: a new run wherever the code does not advance by one
    breaks = torch.nonzero(codes[1:] - codes[:-1] != 1).reshape(-1) + 1
    bounds = [0, *breaks.tolist(), codes.numel()]
    for a, b in zip(bounds[:-1], bounds[1:]):
        code = int(codes[a])
        if code == 0:  # padded vocabulary rows stay zero (runs of padding advance by 0, one row per run)
            continue
        src, row = code >> _SOURCE_SHIFT, (code & ((1 << _SOURCE_SHIFT) - 1)) - 1
        read(entry.sources[src], rows=(row, row + b - a), out=out[a:b])
    return out


def split_to_hf(entry: TensorPlan, full: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of :func:`build_full`: HF ``(name, tensor)`` pairs of a full megatron tensor, one at a time.

    Tensors are views of ``full`` where possible (rows of ``fc1``, the unpadded vocabulary rows);
    q / k / v are copied out one by one.
    """
    if entry.kind == "qkv":
        heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        d, per, rest = cfg.head_dim, heads // groups, tuple(full.shape[1:])
        grouped = full.view(groups, per + 2, d, *rest)
        for name, slot, n in zip(entry.sources, (slice(0, per), slice(per, per + 1), slice(per + 1, per + 2)),
                                 (heads, groups, groups)):
            yield name, grouped[:, slot].reshape(n * d, *rest)
    elif entry.kind == "fc1":
        half = full.shape[0] // 2
        yield entry.sources[0], full[:half]
        yield entry.sources[1], full[half:]
    elif entry.kind == "vocab":
        yield entry.sources[0], full[: cfg.vocab_size]
    else:
        yield entry.sources[0], full


def place_shard(full: torch.Tensor, piece: torch.Tensor, partition: Optional[tuple[int, int]], tp_rank: int,
                tp: int) -> None:
    """Copy TP rank ``tp_rank``'s shard ``piece`` into its place in ``full`` (inverse of :func:`shard`)."""
    if partition is None or tp == 1:
        full.copy_(piece)
        return
    dim, stride = partition
    block = full.shape[dim] // (stride * tp)
    for i in range(stride):
        full.narrow(dim, (i * tp + tp_rank) * block, block).copy_(piece.narrow(dim, i * block, block))


def model_config_from_json(data: dict, source: str) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{source}: unknown ModelConfig fields {unknown}")
    try:
        return ModelConfig(**data)
    except TypeError as exc:
        raise ValueError(f"{source}: invalid model config ({exc})") from None

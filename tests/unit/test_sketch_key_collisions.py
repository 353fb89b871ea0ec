"""Two target layers whose canonical names collide must not share one state key (row moment, update
direction, projection): :func:`install_sketches` refuses them, naming both module paths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_logra.optim import LograConfig, LograOptimizer, NativeConfig
from megatron_logra.parallel import ParallelGroups
from megatron_logra.sketch.capture import install_sketches


class _Layer(nn.Module):
    def __init__(self, h: int, layer_number: int | None = None) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.down_proj = nn.Linear(h, h, bias=False)
        if layer_number is not None:
            self.layer_number = layer_number  # megatron's TransformerLayer numbers layers globally, from 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(x)


class _Stack(nn.Module):
    def __init__(self, h: int, layer_number: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(h, layer_number)])


class _EncDec(nn.Module):
    def __init__(self, numbers: tuple[int | None, int | None] = (None, None)) -> None:
        super().__init__()
        self.encoder = _Stack(8, numbers[0])
        self.decoder = _Stack(8, numbers[1])


def test_encoder_and_decoder_layers_with_one_canonical_name_are_refused():
    model = _EncDec()
    with pytest.raises(ValueError, match=r"encoder\.layers\.0\.mlp\.down_proj and decoder\.layers\.0\.mlp\.down_proj "
                                         r"both map to canonical name .*layer_number"):
        install_sketches(model, ["down_proj"], rank=4)
    # the optimizer refuses at construction too
    with pytest.raises(ValueError, match=r"encoder\.layers\.0\.mlp\.down_proj and decoder\.layers\.0"):
        LograOptimizer(model, LograConfig(targets=["down_proj"], rank=4), NativeConfig(freeze=True), ParallelGroups())


def test_plain_pipeline_chunks_each_with_a_local_layers_0_are_refused():
    chunks = [_Stack(8), _Stack(8)]
    with pytest.raises(ValueError, match=r"0\.layers\.0\.mlp\.down_proj and 1\.layers\.0\.mlp\.down_proj"):
        install_sketches(chunks, ["down_proj"], rank=4)


def test_distinct_global_layer_numbers_get_distinct_keys():
    model = _EncDec(numbers=(1, 2))
    sketches = install_sketches(model, ["down_proj"], rank=4)
    keys = [t.key for t in sketches.targets]
    assert len(keys) == 2 and len(set(keys)) == 2
    sketches.remove()


def test_hf_q_k_v_sharing_a_canonical_name_still_get_distinct_keys():
    layer = nn.Module()
    layer.self_attn = nn.Module()
    for leaf in ("q_proj", "k_proj", "v_proj"):
        setattr(layer.self_attn, leaf, nn.Linear(8, 8, bias=False))
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    sketches = install_sketches(model, ["q_proj", "k_proj", "v_proj"], rank=4)
    keys = [t.key for t in sketches.targets]
    assert len(keys) == 3 and len(set(keys)) == 3 and len({t.name for t in sketches.targets}) == 1
    sketches.remove()

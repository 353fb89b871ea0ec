"""Exporting a trainer checkpoint whose config says the output layer is separate from the embeddings
(``untie_embeddings_and_output_weights``) but which stores no ``output_layer.weight`` is refused, naming the
missing tensor and the checkpoint, and writes nothing; a tied checkpoint (no stored output layer by design)
still exports, its embeddings read once as the tied ``lm_head``."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from safetensors.torch import load_file

from megatron_logra.convert import convert_mcore_to_hf
from megatron_logra.convert.mcore_checkpoint import McoreCheckpoint
from megatron_logra.convert.tensor_plan import megatron_plan
from megatron_logra.models.gpt import ModelConfig, build_gpt

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _cfg(untied: bool) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                       vocab_size=40, seq_length=32, params_dtype="float32",
                       untie_embeddings_and_output_weights=untied)


def _save_tied_model(run, groups, config_cfg: ModelConfig):
    """A checkpoint of a tied model (no ``output_layer.weight`` stored) whose meta.json records ``config_cfg``."""
    from megatron_logra.checkpoint import save_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(_cfg(untied=False), groups, seed=5).eval()
    assert "output_layer.weight" not in dict(model.named_parameters())
    return save_checkpoint(run, 3, model, None, groups, config={"model": dataclasses.asdict(config_cfg)}), model


def test_untied_checkpoint_without_its_output_layer_is_refused(groups, tmp_path):
    step, _ = _save_tied_model(tmp_path / "run", groups, _cfg(untied=True))
    ckpt = McoreCheckpoint(step)
    try:
        assert ckpt.cfg.untie_embeddings_and_output_weights
        with pytest.raises(ValueError) as info:
            ckpt.validate(megatron_plan(ckpt.cfg, 1, 1))
    finally:
        ckpt.close()
    assert "output_layer.weight" in str(info.value) and str(step) in str(info.value)

    out = tmp_path / "hf"
    with pytest.raises(ValueError) as info:
        convert_mcore_to_hf(step, out)
    message = str(info.value)
    assert "'output_layer.weight'" in message and str(step) in message and "untie" in message
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no build directory left either


def test_tied_checkpoint_exports_its_embeddings_as_the_tied_head(groups, tmp_path):
    step, model = _save_tied_model(tmp_path / "run", groups, _cfg(untied=False))
    out = tmp_path / "hf"
    convert_mcore_to_hf(step, out)
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    emb = dict(model.named_parameters())["embedding.word_embeddings.weight"].detach()
    assert torch.equal(tensors["model.embed_tokens.weight"], emb[:40])

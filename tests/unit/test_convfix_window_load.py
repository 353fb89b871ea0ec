"""A checkpoint with a sliding window that no sequence of the run reaches past (Mistral v0.1: ``sliding_window:
4096``, ``max_position_embeddings: 32768``) trains at ``model.seq_length <= window`` and exports, as documented.

The config stage read the checkpoint at the run's ``model.seq_length`` and accepted it, but loading the weights
(``load_hf_into_model``) read it again at its ``max_position_embeddings`` and refused it ("this one has
model.seq_length=32768"), so ``train --model.hf_path`` of such a checkpoint always failed when the context was
longer than the window; an export of such a run could not take the checkpoint as its config template either (a
generated config without the window, with a warning). Both now read it at the run's ``seq_length``. The loaded
model's logits equal transformers' (the windowed model, on sequences within the window), and so do the
exported checkpoint's, whose config.json keeps the window."""

from __future__ import annotations

# test_convert resolves transformers' lazy model modules and torch's device-constructor cache before
# megatron_logra's CPU shim is imported (see there): keep this import first.
from test_convert import REL_TOL, _logits, _megatron  # noqa: I001

import dataclasses
import json
import logging
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from megatron_logra.checkpoint import save_checkpoint
from megatron_logra.convert import convert_mcore_to_hf, load_hf_into_model, model_config_from_hf
from megatron_logra.models.gpt import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

V, WINDOW, T = 70, 24, 20


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A Mistral v0.1-like checkpoint: a window shorter than its context, O(1) logits."""
    config = MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=WINDOW, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config.architectures = ["MistralForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else
                    0.15 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("mistral") / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["sliding_window"] == WINDOW
    return out, model


def _tokens():
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))


def _close(got, ref):
    scale, err = ref.abs().max().item(), (got - ref).abs().max().item()
    assert scale > 0.5 and err <= REL_TOL * scale, f"max |dlogit| {err:.3g} > {REL_TOL} x {scale:.3g}"


def test_a_run_within_the_window_loads_the_weights(mistral, groups):
    hf_dir, hf = mistral
    cfg = model_config_from_hf(hf_dir, base=ModelConfig(seq_length=WINDOW, params_dtype="float32"))
    model = _megatron(cfg, groups)
    load_hf_into_model(model, groups, hf_dir, cfg)
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
    _close(_logits(model, tokens)[..., :V], ref)


def test_a_run_past_the_window_is_still_refused(mistral, groups):
    hf_dir, _ = mistral
    with pytest.raises(ValueError, match=rf"sliding_window={WINDOW} is not supported.*model\.seq_length={WINDOW + 1}"):
        model_config_from_hf(hf_dir, base=ModelConfig(seq_length=WINDOW + 1, params_dtype="float32"))


def test_the_export_of_such_a_run_keeps_the_checkpoints_config(mistral, groups, tmp_path, caplog):
    hf_dir, hf = mistral
    cfg = model_config_from_hf(hf_dir, base=ModelConfig(seq_length=WINDOW, params_dtype="float32"))
    model = _megatron(cfg, groups)
    load_hf_into_model(model, groups, hf_dir, cfg)
    step = save_checkpoint(tmp_path / "run", 3, model, None, groups, config={"model": dataclasses.asdict(cfg)})
    with caplog.at_level(logging.INFO, logger="megatron_logra.convert"):
        convert_mcore_to_hf(step, tmp_path / "out")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert (tmp_path / "out" / "config.json").read_text() == (hf_dir / "config.json").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert exported.config.sliding_window == WINDOW
    tokens = _tokens()
    with torch.no_grad():
        _close(exported(input_ids=tokens).logits, hf(input_ids=tokens).logits)


def test_hf_to_mcore_names_max_position_embeddings_and_the_way_to_train(mistral, tmp_path, capsys):
    """A conversion has no run: it reads the checkpoint at its max_position_embeddings, and its refusal says so
    (it used to name a model.seq_length the user never gave) and how to use the checkpoint instead."""
    from megatron_logra.convert.cli import main

    hf_dir, _ = mistral
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "mc")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"sliding_window={WINDOW} is not supported" in err
    assert "read at its max_position_embeddings=256" in err and "--model.hf_path DIR" in err
    assert "this one has model.seq_length" not in err
    assert not (tmp_path / "mc").exists()

"""A resume whose optimizer state would have other slots than the checkpoint's is refused by name.

Which parameters have LoGRA row moments, AdamW moments or none follows from ``optimizer.logra.targets``
and ``optimizer.native.freeze``; whether the AdamW parameters have fp32 masters from
``model.params_dtype``. A change of any of them is a :class:`CheckpointError` naming the config field,
the checkpoint's value and this run's, raised before anything is loaded (never the tensor store's
key error). Checkpoints that do not record them still load when nothing changed.

Single-process gloo world, one tiny GPT per case.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from megatron_logra.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_logra.checkpoint.integrity import meta_crc32
from megatron_logra.models.gpt import build_gpt
from megatron_logra.optim import build_optimizer
from megatron_logra.optim.config import LograConfig, NativeConfig, OptimizerConfig
from test_checkpoint_checksums import MODEL

DEFAULT = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _model(groups, seed: int, dtype: str = "float32"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gpt(dataclasses.replace(MODEL, params_dtype=dtype), groups, seed=seed)


def _optimizer(model, groups, *, name: str = "logra", targets=DEFAULT, freeze: bool = False, masters: str = "fp32"):
    cfg = OptimizerConfig(name=name, logra=LograConfig(rank=4, targets=list(targets), masters=masters),
                          native=NativeConfig(freeze=freeze))
    return build_optimizer(model, cfg, groups)


def _config(*, name: str = "logra", targets=DEFAULT, freeze: bool = False, masters: str = "fp32",
            dtype: str = "float32") -> dict:
    """The slice of the job's config (meta.json ``config``) the messages quote."""
    return {"model": {"params_dtype": dtype},
            "optimizer": {"name": name, "logra": {"targets": list(targets), "masters": masters},
                          "native": {"freeze": freeze}}}


def _save(groups, tmp_path: Path, **settings) -> Path:
    dtype = settings.pop("dtype", "float32")
    model = _model(groups, seed=3, dtype=dtype)
    optimizer = _optimizer(model, groups, **settings)
    return save_checkpoint(tmp_path / "run", 1, model, optimizer, groups, config=_config(dtype=dtype, **settings))


def _save_with_state(groups, tmp_path: Path, **settings):
    """:func:`_save` of a model and optimizer whose LoGRA row moments were filled with random values (a
    fresh optimizer's are zeros, like the loading one's); returns the checkpoint, the saved weights and
    the saved row moments, for a load to be compared with."""
    model = _model(groups, seed=3)
    optimizer = _optimizer(model, groups, **settings)
    gen = torch.Generator().manual_seed(5)
    for moment in optimizer.row_moments.values():
        moment.copy_(torch.rand(moment.shape, generator=gen, dtype=moment.dtype))
    ckpt = save_checkpoint(tmp_path / "run", 1, model, optimizer, groups, config=_config(**settings))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return ckpt, weights, {k: v.clone() for k, v in optimizer.row_moments.items()}


def _load_and_check(ckpt: Path, model, optimizer, groups, weights: dict, moments: dict) -> None:
    """Load ``ckpt`` into the fresh ``model`` and ``optimizer`` (whose weights differ from the saved ones)
    and check that they then hold the saved weights and row moments."""
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert state.keys() == weights.keys()
    assert not all(torch.equal(v, weights[k]) for k, v in state.items())  # the load has something to do
    load_checkpoint(ckpt, model, optimizer, groups)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    for key, value in weights.items():
        assert torch.equal(state[key], value), key
    assert moments and optimizer.row_moments.keys() == moments.keys()
    for key, value in moments.items():
        assert torch.equal(optimizer.row_moments[key], value), key


def _refused(ckpt: Path, groups, *, dtype: str = "float32", **settings) -> str:
    """The message of the refused load into a fresh model and optimizer built with ``settings``; asserts
    that nothing was modified."""
    fresh = _model(groups, seed=11, dtype=dtype)
    optimizer = _optimizer(fresh, groups, **settings)
    before = {k: v.clone() for k, v in fresh.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, fresh, optimizer, groups)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items() if k in before)
    message = str(info.value)
    assert "not in state dict" not in message and "KeyError" not in message, message
    assert "or start a new run directory" in message, message
    return message


def _forget(ckpt: Path, *keys: str) -> None:
    """Rewrite meta.json as a checkpoint saved before ``keys`` (dotted paths in ``state``) were recorded."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for key in keys:
        node = meta["state"]
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        del node[last]
    meta["meta_crc32"] = meta_crc32(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=1))


def test_the_target_kinds_and_native_freeze_are_recorded(groups, tmp_path):
    ckpt = _save(groups, tmp_path, targets=["q_proj", "linear_fc2", "o_proj", "linear_fc1", "linear_fc2"])
    state = json.loads((ckpt / "meta.json").read_text())["state"]
    assert state["targets"] == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]  # aliases resolved
    assert state["native_freeze"] is False and state["native"]["masters"] == "none"


def test_another_target_set_is_refused_by_name(groups, tmp_path):
    ckpt = _save(groups, tmp_path)
    fewer = _refused(ckpt, groups, targets=DEFAULT[:3])
    assert ("saved with optimizer.logra.targets selecting [linear_fc1,linear_fc2,linear_proj,linear_qkv], this "
            "run's targets select [linear_fc1,linear_proj,linear_qkv]") in fewer, fewer
    assert "set optimizer.logra.targets=[linear_qkv,linear_proj,linear_fc1,linear_fc2]" in fewer, fewer
    more = _refused(ckpt, groups, targets=[*DEFAULT, "output_layer"])
    assert "this run's targets select [linear_fc1,linear_fc2,linear_proj,linear_qkv,output_layer]" in more, more


def test_the_same_targets_by_their_aliases_resume(groups, tmp_path):
    ckpt, weights, moments = _save_with_state(groups, tmp_path)
    fresh = _model(groups, seed=11)
    optimizer = _optimizer(fresh, groups, targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    _load_and_check(ckpt, fresh, optimizer, groups, weights, moments)


def test_unfreezing_the_native_parameters_is_refused_by_name(groups, tmp_path):
    ckpt = _save(groups, tmp_path, freeze=True)
    message = _refused(ckpt, groups, freeze=False)
    assert "saved with optimizer.native.freeze=true, this run has false" in message, message
    assert "set optimizer.native.freeze=true" in message, message


def test_freezing_the_native_parameters_resumes_with_a_warning(groups, tmp_path, caplog):
    """Freezing the non-targets leaves their AdamW state unread (and nothing else): accepted, said so, also
    where that state held fp32 masters."""
    ckpt = _save(groups, tmp_path, freeze=False, dtype="bfloat16")
    fresh = _model(groups, seed=11, dtype="bfloat16")
    optimizer = _optimizer(fresh, groups, freeze=True)
    with caplog.at_level("WARNING", logger="megatron_logra.checkpoint.compat"):
        load_checkpoint(ckpt, fresh, optimizer, groups)
    assert "optimizer.native.freeze=false, this run has true" in caplog.text


def test_a_checkpoint_that_records_neither_still_loads_unchanged(groups, tmp_path):
    ckpt, weights, moments = _save_with_state(groups, tmp_path, freeze=True)
    _forget(ckpt, "targets", "native_freeze", "native.masters")
    fresh = _model(groups, seed=11)
    _load_and_check(ckpt, fresh, _optimizer(fresh, groups, freeze=True), groups, weights, moments)


@pytest.mark.parametrize("name, masters", [("adam", "fp32"), ("logra", "none")])
def test_16_bit_adamw_state_resumed_at_float32_is_refused_by_name(groups, tmp_path, name, masters):
    """Dense AdamW, and LoGRA's non-targets with ``optimizer.logra.masters=none``: the bf16 checkpoint's
    AdamW state holds fp32 masters, a float32 run would continue from the bf16-rounded weights instead."""
    ckpt = _save(groups, tmp_path, name=name, masters=masters, dtype="bfloat16")
    assert json.loads((ckpt / "meta.json").read_text())["state"]["native"]["masters"] == "fp32"
    message = _refused(ckpt, groups, name=name, masters=masters, dtype="float32")
    assert "AdamW state holds fp32 master weights for its parameters (native masters='fp32'), this run has none" \
        in message, message
    assert "model.params_dtype decides it" in message and "resume with model.params_dtype=bfloat16" in message


@pytest.mark.parametrize("name, masters", [("adam", "fp32"), ("logra", "none")])
def test_float32_adamw_state_resumed_at_16_bit_is_refused_by_name(groups, tmp_path, name, masters):
    ckpt = _save(groups, tmp_path, name=name, masters=masters, dtype="float32")
    message = _refused(ckpt, groups, name=name, masters=masters, dtype="bfloat16")
    assert "holds no fp32 master weights for its parameters (native masters='none'), this run has them" \
        in message, message
    assert "resume with model.params_dtype=float32" in message, message


def test_adamw_state_that_does_not_record_its_masters_still_loads_unchanged(groups, tmp_path):
    ckpt = _save(groups, tmp_path, name="adam", dtype="bfloat16")
    _forget(ckpt, "native.masters")
    fresh = _model(groups, seed=11, dtype="bfloat16")
    optimizer = _optimizer(fresh, groups, name="adam")
    load_checkpoint(ckpt, fresh, optimizer, groups)
    assert optimizer.native.masters[0].dtype == torch.float32

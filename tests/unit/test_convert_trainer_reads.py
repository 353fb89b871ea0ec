"""Exporting a trainer checkpoint (``RUN/checkpoints/step_XXXXXXXX``) to HF reads each stored chunk once.

megatron-core's sharded checkpoint stores per-layer tensors as one global ``[num_layers, ...]`` key
made of one chunk per layer (and TP rank). The export must read every stored chunk of the model
exactly once, whatever the number of layers: no stacked key reloaded per layer, no load just to learn
a dtype. Reads are counted at torch.distributed.checkpoint's storage reader
(``FileSystemReader.read_data``), which both megatron-core's ``dist_checkpointing.load`` and direct
DCP loads go through. The exported tensors must equal ``megatron_to_hf`` of the model that was saved
(bitwise, same dtypes).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from megatron_logra.convert import convert_mcore_to_hf
from megatron_logra.models.gpt import ModelConfig, build_gpt
from megatron_logra.models.hf import megatron_to_hf

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

CASES = {
    # Qwen3-like, bf16 (norms stay fp32): mixed dtypes taken from the checkpoint metadata
    "qwen3_bf16_untied": dict(qk_layernorm=True, params_dtype="bfloat16", untie_embeddings_and_output_weights=True),
    # Qwen2-like: QKV bias, tied embeddings (no stored output layer)
    "qwen2_fp32_tied": dict(add_qkv_bias=True, params_dtype="float32", untie_embeddings_and_output_weights=False),
}
LAYERS = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _saved_model(tmp_path, groups, case):
    from megatron_logra.checkpoint import save_checkpoint

    cfg = ModelConfig(num_layers=LAYERS, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, vocab_size=70, seq_length=64, **CASES[case])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(cfg, groups, seed=3).eval()
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    with torch.no_grad():  # distinct values everywhere: a misplaced layer or norm cannot go unnoticed
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    reference = megatron_to_hf({n: p.detach().clone() for n, p in model.named_parameters()}, cfg)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # HF export: the unpadded vocabulary
        if name in reference:
            reference[name] = reference[name][:cfg.vocab_size]
    step = save_checkpoint(tmp_path / "run", 7, model, None, groups, config={"model": dataclasses.asdict(cfg)})
    return step, reference


def _stored_chunks(step) -> set[tuple[str, tuple[int, ...]]]:
    md = FileSystemReader(str(step / "dist")).read_metadata()
    return {(k, tuple(c.offsets)) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") for c in v.chunks}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_export_reads_each_stored_chunk_once(case, groups, tmp_path, monkeypatch):
    step, reference = _saved_model(tmp_path, groups, case)
    stored = _stored_chunks(step)
    assert len({k for k, _ in stored if k.startswith("decoder.layers.")}) >= 5
    assert all(n == LAYERS for k, n in Counter(k for k, _ in stored).items()
               if k.startswith("decoder.layers.") and "linear_fc1.weight" not in k)  # one chunk per layer

    reads: Counter = Counter()
    original = dcp_filesystem.FileSystemReader.read_data

    def counting_read_data(self, plan, planner):
        for item in plan.items:
            reads[(item.storage_index.fqn, tuple(item.storage_index.offset))] += 1
        return original(self, plan, planner)

    monkeypatch.setattr(dcp_filesystem.FileSystemReader, "read_data", counting_read_data)
    convert_mcore_to_hf(step, tmp_path / "hf")
    monkeypatch.undo()

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(exported) == set(reference)
    for name, ref in reference.items():
        assert exported[name].dtype == ref.dtype and torch.equal(exported[name], ref), name

    assert set(reads) == stored  # every stored chunk is needed (weights only were saved)
    again = {chunk: n for chunk, n in reads.items() if n != 1}
    assert not again, f"stored chunks read more than once (key, offset: reads): {again}"

"""The SGLang loader's ``fingerprint`` at engine TP > 1, over real gloo groups of 2 and 4 processes.

Every rank of a sharded engine must write the same record, equal to the TP=1 fingerprint of the
full HF tensors (vocab padding dropped), so the trainer's comparison does not depend on the
engine's TP size. Two engine stand-ins: ``SGLangLlama`` of ``support.sglang_stand_ins`` (its
``org_vocab_size`` counts a shard's real rows) and ``_Engine`` below, laid out like SGLang's
Qwen2/Llama at TP ``T``: fused q/k/v biases, ``num_kv_heads < T`` (each kv head replicated on
``T/G`` ranks), a vocabulary padded at its end and split in equal blocks, with
``shard_indices`` on ``embed_tokens`` and only the global ``org_vocab_size`` on ``lm_head``.
A flipped byte in a sampled row on one rank, or one rank's replica differing from the others,
changes exactly that tensor's fingerprint. The engines are at weight version :data:`VERSION`, the
salt the loader samples rows with, so the reference is ``fingerprint(hf, salt=VERSION)``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_logra.sync import sglang_loader
from megatron_logra.sync.fingerprint import drift, fingerprint, fingerprint_salt, sampled_rows_of
from megatron_logra.sync.sglang_fingerprint import MISMATCH_PREFIX
from megatron_logra.sync.sglang_loader import (FINGERPRINT_PARAM, command_as_named_tensors, engine_hf_view, read_state,
                                               sync_loader)
from support.gloo import spawn_group
from support.sglang_stand_ins import SGLangLlama, hf_state

H, G, D, HID, F, V, LAYERS = 8, 2, 4, 16, 24, 37, 2
VERSION = 7  # the engines' weight version: the salt of their row samples


def _full(seed: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (V, HID), "lm_head.weight": (V, HID), "model.norm.weight": (HID,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (H * D, HID), p + "self_attn.k_proj.weight": (G * D, HID),
                       p + "self_attn.v_proj.weight": (G * D, HID), p + "self_attn.q_proj.bias": (H * D,),
                       p + "self_attn.k_proj.bias": (G * D,), p + "self_attn.v_proj.bias": (G * D,),
                       p + "self_attn.o_proj.weight": (HID, H * D), p + "mlp.gate_proj.weight": (F, HID),
                       p + "mlp.up_proj.weight": (F, HID), p + "mlp.down_proj.weight": (HID, F),
                       p + "input_layernorm.weight": (HID,), p + "post_attention_layernorm.weight": (HID,)})
    return {k: torch.randn(*s, generator=gen).to(torch.float32 if k.endswith("norm.weight") else torch.bfloat16)
            for k, s in shapes.items()}


def _param(module: nn.Module, name: str, t: torch.Tensor) -> None:
    module.register_parameter(name, nn.Parameter(t.clone(), requires_grad=False))


def _linear(tp: int, rank: int, **tensors) -> nn.Module:
    m = nn.Module()
    m.tp_size, m.tp_rank = tp, rank
    for name, t in tensors.items():
        _param(m, name, t)
    return m


class _Engine(nn.Module):
    """SGLang's parameters of rank ``rank`` of a TP ``tp`` engine (kv heads replicated when ``G < tp``)."""

    def __init__(self, hf: dict[str, torch.Tensor], tp: int, rank: int):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=H, num_key_value_heads=G, head_dim=D, hidden_size=HID)
        hq, f, cols = H // tp, F // tp, H * D // tp
        kv = range(rank * G // tp, (rank + 1) * G // tp) if G >= tp else range(rank // (tp // G), rank // (tp // G) + 1)
        q_rows, kv_rows = slice(rank * hq * D, (rank + 1) * hq * D), slice(kv.start * D, kv.stop * D)
        local = -(-V // tp)  # the padded vocabulary, split in equal blocks; padding at its end
        lo, hi = min(rank * local, V), min((rank + 1) * local, V)

        def vocab(name: str, with_indices: bool) -> nn.Module:
            m = nn.Module()
            m.org_vocab_size = V
            if with_indices:
                m.shard_indices = SimpleNamespace(org_vocab_start_index=lo, org_vocab_end_index=hi)
            pad = torch.full((local - (hi - lo), HID), 7.0).to(torch.bfloat16)
            _param(m, "weight", torch.cat([hf[name][lo:hi], pad]))
            return m

        self.model = nn.Module()
        self.model.embed_tokens = vocab("model.embed_tokens.weight", True)
        self.model.layers = nn.ModuleList()
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv = {leaf: torch.cat([hf[f"{a}q_proj.{leaf}"][q_rows], hf[f"{a}k_proj.{leaf}"][kv_rows],
                                    hf[f"{a}v_proj.{leaf}"][kv_rows]]) for leaf in ("weight", "bias")}
            layer = nn.Module()
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            layer.self_attn.qkv_proj = _linear(tp, rank, **qkv)
            o_cols = hf[a + "o_proj.weight"][:, rank * cols: (rank + 1) * cols]
            layer.self_attn.o_proj = _linear(tp, rank, weight=o_cols)
            gate_up = torch.cat([hf[m + "gate_proj.weight"][rank * f: (rank + 1) * f],
                                 hf[m + "up_proj.weight"][rank * f: (rank + 1) * f]])
            layer.mlp.gate_up_proj = _linear(tp, rank, weight=gate_up)
            layer.mlp.down_proj = _linear(tp, rank, weight=hf[m + "down_proj.weight"][:, rank * f: (rank + 1) * f])
            for norm in ("input_layernorm", "post_attention_layernorm"):
                setattr(layer, norm, _linear(tp, rank, weight=hf[p + norm + ".weight"]))
            self.model.layers.append(layer)
        self.model.norm = _linear(tp, rank, weight=hf["model.norm.weight"])
        self.lm_head = vocab("lm_head.weight", False)


def _record(model: nn.Module) -> dict:
    """The loader's fingerprint of ``model`` at weight version :data:`VERSION` (set first, as a refit does)."""
    sync_loader(model, command_as_named_tensors({"op": "set_version", "version": VERSION}))
    sync_loader(model, command_as_named_tensors({"op": "fingerprint", "nonce": 1}))
    state = read_state(model)
    assert state["ok"] and state["fingerprint_error"] is None, state
    record = read_state(model, FINGERPRINT_PARAM)
    assert record["version"] == VERSION == fingerprint_salt(record["fingerprint"])  # the rows of its version
    return record["fingerprint"]


@torch.no_grad()
def _flip(model: nn.Module, param: str, row: int, col: int = 0) -> None:
    """Flip the lowest bit of one element (row ``row`` of the parameter, flattened column ``col``)."""
    w = dict(model.named_parameters())[param].data
    bits = w.view({2: torch.int16, 4: torch.int32}[w.element_size()])
    bits.reshape(1 if w.dim() <= 1 else w.shape[0], -1)[row, col] ^= 1


def _cases(world: int, rank: int) -> dict[str, dict]:
    out = {}
    last = world - 1
    full = _full()
    down = "model.layers.1.mlp.down_proj.weight"
    row = sampled_rows_of(down, full[down].shape, salt=VERSION)[1]
    model = _Engine(full, world, rank)
    out["clean"] = _record(model)
    if rank == last:  # a sampled row of a tensor whose columns are split: only this rank holds the byte
        _flip(model, down, row)
    out["flipped"] = _record(model)
    model = _Engine(full, world, rank)
    if rank == 1:  # one replica differs: a norm, and at G < T kv head 0 (on ranks 0..T/G-1; k row 0 is sampled)
        _flip(model, "model.layers.1.post_attention_layernorm.weight", 0, col=5)
        if G < world:
            _flip(model, "model.layers.0.self_attn.qkv_proj.weight", H // world * D, col=3)
    out["replica"] = _record(model)
    if world == 2:  # test_sglang_client's stand-in (shard-local org_vocab_size, no kv replication)
        out["stand_in"] = _record(SGLangLlama(hf_state(3), tp=2, rank=rank))
    return out


def _worker(rank: int, world: int, tmp: str) -> None:
    sglang_loader._tp_cpu_group = lambda: dist.group.WORLD  # SGLang's get_tp_group().cpu_group
    result = _cases(world, rank)
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


def _run(world: int, tmp_path) -> list[dict]:
    spawn_group(_worker, world, tmp_path, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r == results[0] for r in results[1:]), "TP ranks wrote different fingerprint records"
    return results[0]


def _check(got: dict, world: int) -> None:
    want = fingerprint(_full(), salt=VERSION)
    assert got["clean"] == want
    assert drift(got["flipped"], want) == ["model.layers.1.mlp.down_proj.weight"]
    replicas = ["model.layers.1.post_attention_layernorm.weight"]
    replicas += ["model.layers.0.self_attn.k_proj.weight"] if G < world else []
    assert drift(got["replica"], want) == sorted(replicas)
    assert all(got["replica"][n].startswith(MISMATCH_PREFIX) for n in replicas)


@pytest.mark.distributed
def test_tp2_fingerprint_equals_the_full_hf_fingerprint_on_every_rank(tmp_path):
    got = _run(2, tmp_path)
    _check(got, 2)
    hf = hf_state(3)
    want = fingerprint(hf, salt=VERSION)
    assert got["stand_in"] == fingerprint(engine_hf_view(SGLangLlama(hf)), salt=VERSION) == want


@pytest.mark.distributed
def test_tp4_fingerprint_with_replicated_kv_heads_and_padded_vocab(tmp_path):
    _check(_run(4, tmp_path), 4)


def test_tp1_fingerprint_is_the_whole_tensor_fingerprint_of_the_hf_view():
    for model in (_Engine(_full(), 1, 0), SGLangLlama(hf_state(1), vocab_pad=24)):
        view = engine_hf_view(model)
        assert _record(model) == fingerprint(view, salt=VERSION)
    assert fingerprint(engine_hf_view(_Engine(_full(), 1, 0))) == fingerprint(_full())


def test_tp2_without_a_group_reports_a_fingerprint_error_instead_of_hanging():
    model = _Engine(_full(), 2, 0)
    sync_loader(model, command_as_named_tensors({"op": "fingerprint"}))
    state = read_state(model)
    assert state["ok"] and state["fingerprint_version"] is None and "TP=2" in state["fingerprint_error"]

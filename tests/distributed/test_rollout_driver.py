"""One rank of each model-parallel group drives the rollout engine; every rank gets its result
(``rollout.driver``), over a real gloo group of 2 processes on CPU.

* Embedded engine: the two ranks hold different weights, yet both get rank 0's rollouts, equal to
  what rank 0's engine samples alone; rank 0's error reaches rank 1.
* SGLang engine: only the driver talks to SGLang (``support.sglang_stand_ins.FakeSGLang`` and
  ``FakeTarget``); generation, sketch deltas, rejections, driver failures and full refits (whose
  tensor stream is itself a collective of all ranks) reach every rank the same way, and nobody hangs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.rollout import SamplingParams
from megatron_logra.rollout.driver import share_from_driver
from megatron_logra.rollout.embedded import EmbeddedEngine
from megatron_logra.rollout.sglang_engine import SGLangEngine
from megatron_logra.sync import SyncError
from support.gloo import spawn_group
from support.sglang_stand_ins import PADDED, VOCAB, FakeSGLang, FakeTarget

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")]

CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=64, seq_length=64, init_std=0.1, layernorm_epsilon=1e-5)
PROMPTS = [[3, 17, 5], [9, 1, 44, 2, 8, 30, 12, 7, 61], [40], [22, 23, 24, 25, 26, 27]]


def _embedded_worker(rank: int, world: int, out: str) -> None:
    # different weights on the two ranks: the group must still get rank 0's rollouts everywhere
    engine = EmbeddedEngine(CFG, init_seed=rank, gen_group=dist.group.WORLD)
    alone = EmbeddedEngine(CFG, init_seed=rank).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=4))
    shared = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=4))
    with pytest.raises(ValueError, match="outside" if rank == 0 else "driving the rollout engine.*outside"):
        engine.generate([[CFG.vocab_size + 5]], SamplingParams(max_new_tokens=2))  # rank 0's bad input reaches both
    rows = [[(r.completion_ids, r.logprobs) for r in alone], [(r.completion_ids, r.logprobs) for r in shared]]
    gathered: list = [None, None]
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        torch.save(gathered, out)


def test_embedded_rank0_of_the_group_samples_for_every_rank(tmp_path):
    out = tmp_path / "rows.pt"
    spawn_group(_embedded_worker, 2, tmp_path, str(out))
    (alone0, shared0), (alone1, shared1) = torch.load(out)
    assert alone0 != alone1  # the two ranks' own engines really differ
    assert shared0 == shared1 == alone0


def _sglang_worker(rank: int, world: int) -> None:
    group = dist.new_group([0, 1])
    driver = rank == 0
    fake = FakeSGLang(seed=3) if driver else None
    target = FakeTarget(version=2) if driver else None
    engine = SGLangEngine(generate_fn=fake, target=target, vocab_size=VOCAB, padded_vocab_size=PADDED,
                          gen_group=group, sync_group=dist.group.WORLD)
    assert engine.weight_version == 2
    rollouts = engine.generate([[1, 2], [4]], SamplingParams(temperature=1.0, max_new_tokens=5))
    gathered: list = [None, None]
    dist.all_gather_object(gathered, [(r.completion_ids, r.logprobs, r.finished) for r in rollouts])
    assert gathered[0] == gathered[1]
    assert engine.apply_sketch_delta(b"ok") == 3
    with pytest.raises(SyncError) as err:
        engine.apply_sketch_delta("bad")
    assert err.value.kind == "gap" and "does not follow" in str(err.value) and engine.weight_version == 3
    with pytest.raises(OSError if driver else RuntimeError, match="connection reset"):
        engine.apply_sketch_delta("boom")
    engine.update_weights_full({}, 9)
    assert engine.weight_version == 9 and engine.fingerprint() == {"w": "hash-9"}
    assert share_from_driver(lambda: dist.get_rank(), group) == 0

    pulled = []

    def stream():  # like rl.weights.iter_hf_params: every item is a collective of all ranks
        for i in range(4):
            t = torch.full((2,), float(i))
            dist.all_reduce(t)
            pulled.append(i)
            yield f"w{i}", t

    engine.update_weights_full(stream(), 12)
    assert engine.weight_version == 12 and pulled == [0, 1, 2, 3]
    pulled.clear()
    with pytest.raises(OSError if driver else RuntimeError, match="refit upload failed"):
        engine.update_weights_full(stream(), 13)  # the driver fails after one tensor: nobody hangs
    assert pulled == [0, 1, 2, 3] and engine.weight_version == 12
    if driver:
        assert target.calls == ["delta", "delta", "delta", "full", "full", "full"] and len(fake.payloads) == 1


def test_sglang_driver_generates_and_syncs_for_the_group(tmp_path):
    spawn_group(_sglang_worker, 2, tmp_path)

"""A model built without initialisation carries megatron-core's TP split attributes.

Runs that load every weight next (resume, a Hugging Face checkpoint, the KL penalty's reference
model) build with ``initialize=False``; megatron-core then skips its initialisers, which are
where it marks TP-split weights (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``). Without the marks every gather and load treats a shard as a whole tensor
(an RL resume at TP 2 failed at its first refit). The reference is megatron-core itself: the same
model built with initialisation, parameter by parameter, on 2 gloo ranks at TP 2 and at PP 2.
"""

from __future__ import annotations

import json
import os

import pytest

from support.gloo import spawn_group

pytestmark = pytest.mark.distributed

VARIANTS = {
    "swiglu-untied": {},
    "gelu-bias-tied": {"swiglu": False, "add_bias_linear": True, "add_qkv_bias": True,
                       "untie_embeddings_and_output_weights": False},
}


def _marks(model) -> dict[str, list]:
    return {name: [getattr(p, "tensor_model_parallel", None), getattr(p, "partition_dim", None),
                   getattr(p, "partition_stride", None)] for name, p in model.named_parameters()}


def _worker(rank: int, world: int, out_dir: str, tp: int, pp: int) -> None:
    from megatron_logra import cpu_shim
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, initialize_parallel

    cpu_shim.activate()
    groups = initialize_parallel(ParallelConfig(tp=tp, pp=pp))
    result = {}
    for variant, fields in VARIANTS.items():
        cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                          vocab_size=100, **fields)
        built = _marks(build_gpt(cfg, groups, seed=1, initialize=True))
        bare = _marks(build_gpt(cfg, groups, seed=1, initialize=False))
        result[variant] = {"initialized": built, "bare": bare}
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_an_uninitialised_model_carries_megatrons_split_attributes(tmp_path, tp, pp):
    spawn_group(_worker, 2, tmp_path, str(tmp_path), tp, pp)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for variant, marks in result.items():
            initialized, bare = marks["initialized"], marks["bare"]
            assert set(initialized) == set(bare)
            split = [n for n, m in initialized.items() if m[0]]
            assert split, f"{variant}: megatron marked no parameter as TP-split"
            assert bare == initialized, {n: (initialized[n], bare[n]) for n in bare if bare[n] != initialized[n]}

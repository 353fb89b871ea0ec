"""Worker for ``test_weights_stream.py``: the streamed full weights and the row-sampled trainer
fingerprint at a (TP, PP) layout against whole-model references, on a bf16 GPT with GQA, QKV
biases and fp32 norms.

Launch: ``torchrun --nproc-per-node N weights_stream_worker.py OUT TP PP``. Global rank 0 writes
``OUT/result.json``; the test asserts on it.

References (independent of the code under test): every stage's ``gather_full_state`` (fp32),
merged over the pipeline group with ``all_gather_object``, mapped with ``megatron_to_hf`` and
fingerprinted whole with ``sync.fingerprint.fingerprint``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(out: str, tp: int, pp: int) -> None:
    torch.set_num_threads(1)
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.models.hf import megatron_to_hf
    from megatron_logra.models.layout import gather_full_state, global_param_names
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from megatron_logra.rl.weights import iter_full_params, iter_hf_params, trainer_fingerprint
    from megatron_logra.rollout.embedded import EmbeddedEngine
    from megatron_logra.sync.fingerprint import drift, fingerprint, fingerprint_salt

    groups = initialize_parallel(ParallelConfig(tp=tp, pp=pp), seed=7)
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      vocab_size=80, seq_length=32, add_qkv_bias=True, params_dtype="bfloat16")
    model = build_gpt(cfg, groups, seed=7)
    result: dict = {"rank": dist.get_rank()}

    # reference: whole stages, merged over PP (first stage's tied/duplicate embedding wins)
    stages = [None] * groups.pp_size
    local = gather_full_state(model, groups.tp)
    if groups.pp_size > 1 and not groups.pp_first:
        local.pop("embedding.word_embeddings.weight", None)
    dist.all_gather_object(stages, local, group=groups.pp)
    ref: dict[str, torch.Tensor] = {}
    for part in stages:
        ref.update(part)

    streamed = list(iter_full_params(model, groups))
    names = [n for n, _ in streamed]
    result["stream_sorted_unique"] = names == sorted(set(names))
    result["stream_names_equal"] = sorted(ref) == names
    result["stream_bitwise"] = all(torch.equal(t.float().cpu(), ref[n]) for n, t in streamed if n in ref)
    dtypes = {n: str(t.dtype) for n, t in streamed}
    result["stream_dtypes"] = sorted(set(dtypes.values()))

    hf_ref = megatron_to_hf(ref, cfg, tp=tp)
    want_bf16 = fingerprint({k: v.to(torch.bfloat16) for k, v in hf_ref.items()})
    got_bf16 = trainer_fingerprint(model, groups, cfg, dtype=torch.bfloat16)
    result["fp_bf16_drift"] = drift(got_bf16, want_bf16)
    result["fp_native_drift"] = drift(trainer_fingerprint(model, groups, cfg),
                                      fingerprint(dict(iter_hf_params(model, groups, cfg))))
    result["num_hf_tensors"] = len(want_bf16)

    # a streamed refit of an embedded engine on every rank, then the engine's own fingerprint
    engine = EmbeddedEngine(cfg, tp=tp, dtype=torch.bfloat16, init_seed=1)
    engine.update_weights_full(iter_hf_params(model, groups, cfg), 3)
    result["engine_version"] = engine.weight_version
    engine_fp = engine.fingerprint()
    result["engine_salt"] = fingerprint_salt(engine_fp)  # the engine samples the rows of its version
    result["engine_drift"] = drift(engine_fp, trainer_fingerprint(model, groups, cfg, dtype=torch.bfloat16,
                                                                  salt=result["engine_salt"],
                                                                  vocab_rows=engine.fingerprint_vocab_rows))

    # perturb TP rank 1 of the last stage: its block of linear_fc1 (column parallel, stride 2) and
    # of linear_proj (row parallel); each changes rows every fingerprint samples (the last rows /
    # a column block of every row)
    last_layer = None
    if groups.pp_last and groups.tp_rank == tp - 1:
        gnames = global_param_names(model)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(("mlp.linear_fc1.weight", "self_attention.linear_proj.weight")):
                    if last_layer is None or gnames[pname].split(".")[2] == last_layer:
                        last_layer = gnames[pname].split(".")[2]
                        p.add_(1.0)
    flag = [last_layer]
    dist.broadcast_object_list(flag, src=dist.get_world_size() - 1)
    result["perturbed_layer"] = flag[0]
    result["perturbed_drift"] = drift(trainer_fingerprint(model, groups, cfg, dtype=torch.bfloat16), got_bf16)

    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

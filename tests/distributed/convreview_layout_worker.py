"""Rank side of ``test_convreview_hf_layouts.py``: a Hugging Face checkpoint loaded, trained-checkpointed and
exported at TP=2 or PP=2 (gloo, 2 ranks).

``python -m torch.distributed.run --nproc-per-node 2 convreview_layout_worker.py HF_DIR TP PP OUT``:

1. ``model_config_from_hf`` + ``build_gpt`` + ``load_hf_into_model`` at ``(TP, PP)``;
2. the logits of ``OUT/tokens.pt`` over the whole vocabulary (TP: the vocabulary shards gathered; PP: the
   first stage's hidden states sent to the last stage), written by the last stage's TP rank 0 to
   ``OUT/logits.pt``;
3. ``save_checkpoint`` (weights only) to ``OUT/run``, then rank 0 exports it with ``convert_mcore_to_hf``
   to ``OUT/export`` (no template: a generated config.json) and ``convert_hf_to_mcore`` converts the HF
   directory at the same layout to ``OUT/mc`` (checked by the test against the loaded shards,
   ``OUT/shard_tp{t}_pp{p}.pt``).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main(hf_dir: str, tp: int, pp: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_logra.checkpoint import save_checkpoint
    from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf, load_hf_into_model, model_config_from_hf
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    torch.set_num_threads(1)
    out_dir = Path(out)
    groups = initialize_parallel(ParallelConfig(tp=tp, pp=pp, backend="gloo"))
    cfg = model_config_from_hf(hf_dir, base=ModelConfig(seq_length=32, params_dtype="float32"))
    model = build_gpt(cfg, groups, seed=7).eval()
    load_hf_into_model(model, groups, hf_dir, cfg)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               out_dir / f"shard_tp{groups.tp_rank}_pp{groups.pp_rank}.pt")

    tokens = torch.load(out_dir / "tokens.pt")
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    rank = dist.get_rank()
    with torch.no_grad():
        if pp > 1:  # one layer block per stage: stage 0's hidden states [s, b, h] go to stage 1
            h = torch.empty(tokens.shape[1], tokens.shape[0], cfg.hidden_size)
            if groups.pp_first:
                h = model(tokens, positions, None)
                dist.send(h.contiguous(), dst=1)
                logits = None
            else:
                dist.recv(h, src=0)
                model.set_input_tensor(h)
                logits = model(tokens, positions, None)
        else:
            logits = model(tokens, positions, None)
            if tp > 1:  # vocabulary-parallel shards along the last axis
                parts = [torch.empty_like(logits) for _ in range(tp)]
                dist.all_gather(parts, logits.contiguous(), group=groups.tp)
                logits = torch.cat(parts, dim=-1)
    if logits is not None and groups.tp_rank == 0:
        torch.save(logits, out_dir / "logits.pt")

    save_checkpoint(out_dir / "run", 1, model, None, groups, config={"model": dataclasses.asdict(cfg)})
    if rank == 0:
        convert_mcore_to_hf(out_dir / "run", out_dir / "export")
        convert_hf_to_mcore(hf_dir, out_dir / "mc", tp=tp, pp=pp)
    dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

"""Worker for ``test_driver_sync.py``: sketch-delta sync to an engine driven by one rank.

An :class:`SGLangEngine` whose sync target (on global rank 0 only) is a real
:class:`EmbeddedEngine` -- it has the target protocol: ``weight_version``,
``apply_sketch_delta(bytes)``, ``update_weights_full``, ``fingerprint`` -- so the trainer side
runs exactly as with SGLang: one driving rank, the others only in the collectives. Three LoGRA
updates of a megatron GPT (real forward/backward through megatron's schedule) are synced with
``PolicySync``; the drift check runs after every update. Before a fourth, a partial refit leaves the
driver's engine at an unknown version: its rejection of the delta must reach every rank, which all fall back
to one full refit together (no hang). Mode ``owned``: every rank syncs its own embedded engine; the
last rank's engine is corrupted before update 3 and left at an unknown version before update 4, and
every rank must take the same refits (a rank refitting alone would hang the others' collectives).

Launch: ``torchrun --nproc-per-node N driver_sync_worker.py OUT CASE...``, each ``CASE`` ``TP,PP,MODE,DTYPE``
(``MODE`` ``driven`` or ``owned``; ``DTYPE`` ``float32`` or ``bfloat16``: the merges round stochastically, with noise
keyed by canonical rows and columns, which a TP- or PP-sharded trainer and the TP=1 engine must draw alike). The
cases run one after the other in the launch (each on megatron groups built anew, its model, optimizer and engines
its own; the default process group is kept), saving a launch's start-up per case. For each case every rank writes
``OUT/CASE/rank{r}.json``; the test asserts on them. Reference for the engine's weights: the
trainer's full weights streamed by ``rl.weights.iter_hf_params`` (compared bit for bit).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NUM_UPDATES = 3


def _lm_batch(step: int, cfg, rows: int = 4):
    from megatron_logra.train.step import Batch

    gen = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_length + 1), generator=gen)
    pos = torch.arange(cfg.seq_length).expand(rows, -1).contiguous()
    return Batch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), torch.ones(rows, cfg.seq_length), pos)


def run_case(out: str, tp: int, pp: int, mode: str = "driven", dtype: str = "float32") -> None:
    Path(out).mkdir(parents=True, exist_ok=True)  # every rank: the case's run directory
    from megatron_logra.optim import LograConfig, NativeConfig, OptimizerConfig, build_optimizer
    from megatron_logra.models.gpt import ModelConfig, build_gpt
    from megatron_logra.parallel import ParallelConfig, initialize_parallel
    from megatron_logra.rl.policy_sync import PolicySync
    from megatron_logra.rl.weights import iter_hf_params
    from megatron_logra.rollout.embedded import EmbeddedEngine
    from megatron_logra.rollout.sglang_engine import SGLangEngine
    from megatron_logra.sync.config import SyncConfig
    from megatron_logra.train.step import forward_backward

    groups = initialize_parallel(ParallelConfig(tp=tp, pp=pp), seed=7)
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      vocab_size=80, seq_length=16, params_dtype=dtype)
    model = build_gpt(cfg, groups, seed=7)
    opt = build_optimizer(model, OptimizerConfig(logra=LograConfig(rank=8, lr=1e-2, seed=3),
                                                 native=NativeConfig(freeze=True)), groups)
    owned = mode == "owned"  # every rank syncs its own embedded engine (the default engine's arrangement)
    driver = owned or dist.get_rank() == 0
    target = EmbeddedEngine(cfg, tp=tp, init_seed=1, dtype=cfg.torch_dtype) if driver else None

    def no_generation(payload: dict):
        raise AssertionError("this test does not generate")

    engine = target if owned else SGLangEngine(
        generate_fn=no_generation if driver else None, target=target, vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.padded_vocab_size(tp), gen_group=groups.mp, sync_group=groups.mp)
    last = dist.get_world_size() - 1  # in "owned" mode the faults hit this rank's engine only
    sync = PolicySync(SyncConfig(check_interval=1, max_master_drift=0.0), model=model, model_cfg=cfg, optimizer=opt, engine=engine,
                      groups=groups, run_dir=Path(out))
    sync.full(0)
    records = []
    for step in range(1, NUM_UPDATES + 2):
        if owned and step == NUM_UPDATES and dist.get_rank() == last:  # silent corruption on one rank's engine
            with torch.no_grad():
                next(iter(target.model.parameters())).view(-1)[0] += 1.0
        if step == NUM_UPDATES + 1 and driver and (not owned or dist.get_rank() == last):
            # a refit from elsewhere stopped part-way: the engine's version is unknown (-1), so it
            # rejects the next delta -- on the driver only (owned: on the last rank only)
            name, param = next(iter(target.model.named_parameters()))
            try:
                target.update_weights_full(iter([(name, param.detach().clone())]), NUM_UPDATES)  # a stream
            except ValueError:
                pass
            assert target.weight_version == -1
        opt.zero_grad()
        result = forward_backward(model, [_lm_batch(step, cfg)], groups)
        update = opt.prepare(num_tokens=result.num_tokens)
        assert not update.skipped, update.reason
        factors = sync.factors(update, 1.0)
        opt.apply(update, 1.0, factors=factors)
        records.append(sync.push(update, 1.0, factors, step - 1, step))
    # every rank takes part in the stream; the driver checks its engine against it
    differ, num_tensors = [], 0
    for name, full in iter_hf_params(model, groups, cfg):
        num_tensors += 1
        if driver:
            mine = dict(target.model.named_parameters())[name].detach()
            if not torch.equal(mine, full.to(mine.dtype)):
                differ.append(name)
    result = {"rank": dist.get_rank(), "receives": sync.receives, "version": engine.weight_version,
              "records": records, "differ": differ, "num_tensors": num_tensors,
              "target_version": target.weight_version if driver else None}
    (Path(out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


def main(out: str, cases: list[str]) -> None:
    from megatron_logra.parallel import destroy_parallel

    torch.set_num_threads(1)
    for case in cases:
        tp, pp, mode, dtype = case.split(",")
        run_case(str(Path(out) / case), int(tp), int(pp), mode, dtype)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""Train recipes of real model sizes on GPUs: ``qwen2.5-1.5b``, ``qwen2.5-7b`` and ``27b``.

Shapes come from :mod:`megatron_logra.models.presets` (the ones the memory planner uses); weights and
tokenizer from a local Hugging Face checkpoint given with ``--model.hf_path`` (its architecture
fields replace the preset's; without one the run starts from random weights and says so: no supervised
warm start at these sizes). Layouts: 1.5B at TP 1 with micro-batch 4 (one GPU, or DP = GPUs), 7B at
TP 4 with micro-batch 4 (docs/memory.md's TP), 27B at TP 8 with micro-batch 2 (docs/memory.md's
layout); full activation recompute, LoGRA rank 128 with fp32 masters, sequence length 4096. Each fits
its own memory preflight (``train.memory_check``, which plans micro-batch × ``model.seq_length`` and
the frozen non-targets) on 80 GB GPUs with the engine's 30%: 1.5B +27.3% headroom (57.94 GiB of
79.65 GiB; at micro-batch 8 it would be OOM by 1.1%), 7B (TP4 × DP2) +38.4%, 27B +31.3% -- what
``megatron-logra memory --model qwen2.5-1.5b --tp 1 --gpus 1 --micro-batch 4 --seq-len 4096 --rank 128
--recompute full --engine-fraction 0.3 --gpu-memory 81559MiB --optimizer logra --freeze-native`` prints
(7B: ``--model qwen2.5-7b --tp 4 --gpus 8``; 27B: ``--model 27b --tp 8 --gpus 8 --micro-batch 2``).
Rollouts come from SGLang (``rl.rollout.engine=sglang``: an in-process
``sglang.Engine`` per DP replica on the replica's GPUs with 30% of their memory, or
``--rl.rollout.sglang_url`` for a running server), kept in sync by sketch deltas.

LoGRA runs the *paper* recipe (token-normalised sketches, per-layer norm restoration, global update
ratio 6e-5, step size from the predicted-KL controller, budget 2e-4 -> 2e-5 over 300 updates);
non-target parameters (embeddings, norms, output layer) are frozen, so the KL probe sees every
trained parameter.

``model.transformer_impl`` stays ``local`` (the forward-mode KL probe, exact). For TE / FP8 /
sequence parallelism use ``model.transformer_impl=transformer_engine model.sequence_parallel=true
model.fp8=hybrid`` (see examples/); the KL probe then runs by finite differences (``kl.probe=auto``).

The factories import the config sections when called; :mod:`megatron_logra.config.recipes` registers them
in its ``RECIPES``.
"""

from __future__ import annotations

import logging
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["LARGE_RECIPES", "large_recipe"]

_LAYOUTS = {
    # preset: (tensor-parallel size, RL micro-batch in sequences), chosen so that each run fits its own memory
    # preflight on 80 GB GPUs (tests/unit/test_recipes_large.py checks it)
    "qwen2.5-1.5b": (1, 4),
    "qwen2.5-7b": (4, 4),
    "27b": (8, 2),
}


def large_recipe(preset: str):
    """LoGRA RL recipe (a ``RunConfig``) for the model preset ``preset`` on GPUs."""
    from megatron_logra.config.run import RunConfig
    from megatron_logra.config.train import TrainConfig
    from megatron_logra.kl.controller import KLConfig
    from megatron_logra.models.presets import get_preset
    from megatron_logra.optim.config import LograConfig, NativeConfig, OptimizerConfig
    from megatron_logra.parallel import ParallelConfig
    from megatron_logra.rewards import TaskConfig
    from megatron_logra.rl.config import RLConfig, RolloutConfig, SFTConfig
    from megatron_logra.sync.config import SyncConfig

    if preset not in _LAYOUTS:
        raise ValueError(f"no large recipe for preset {preset!r}; choose one of {', '.join(_LAYOUTS)}")
    tp, micro_batch = _LAYOUTS[preset]
    model = get_preset(preset)
    model.recompute = "full"
    model.transformer_impl = "local"
    run = preset.replace(".", "_")
    return RunConfig(
        job="rl",
        model=model,
        parallel=ParallelConfig(tp=tp, pp=1),
        optimizer=OptimizerConfig(
            logra=LograConfig(rank=128, recipe="paper", update_ratio=6e-5, masters="fp32", algorithm="row_adam"),
            native=NativeConfig(freeze=True),
        ),
        task=TaskConfig(datasets=["basic_arithmetic", "chain_sum", "gcd", "lcm", "simple_equations"], num_eval=200),
        rl=RLConfig(steps=300, prompts_per_step=64, group_size=8, micro_batch_size=micro_batch, eval_interval=25,
                    prompt_template="{prompt}\nAnswer with the final result only.\n",
                    rollout=RolloutConfig(engine="sglang", temperature=1.0, max_new_tokens=512,
                                          mem_fraction_static=0.3)),
        kl=KLConfig(mode="predicted", budget_start=2e-4, budget_end=2e-5, horizon=300),
        # weights come from --model.hf_path; without it the run starts from random weights (a throughput or
        # memory run), never from a supervised warm start of a multi-billion-parameter model held whole
        sft=SFTConfig(steps=0, cache=False),
        sync=SyncConfig(mode="delta", anchor_interval=50),
        train=TrainConfig(run_dir=f"runs/{run}", log_interval=1, save_interval=50),
    )


def _factory(preset: str) -> Callable:
    def recipe():
        return large_recipe(preset)

    recipe.__name__ = preset.replace(".", "_").replace("-", "_")
    tp, micro_batch = _LAYOUTS[preset]
    recipe.__doc__ = (f"{preset}: LoGRA RL on GPUs (TP {tp}, micro-batch {micro_batch}, full recompute, rank 128, "
                      "paper recipe, predicted-KL control); pass --model.hf_path")
    return recipe


LARGE_RECIPES: dict[str, Callable] = {name: _factory(name) for name in _LAYOUTS}
"""Recipe name (= preset name) -> factory of a fresh ``RunConfig``."""

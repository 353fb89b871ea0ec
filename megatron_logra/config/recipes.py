"""The named recipes (:data:`RECIPES`, name -> a function returning a fresh :class:`RunConfig`): the CPU
recipes defined here (``tiny``, ``tiny-adam``, ``lm-tiny``, ``lm-tiny-adam``) and the GPU recipes of real
sizes that :mod:`megatron_logra.config.recipes_large` defines and this module registers."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from megatron_logra.config.recipes_large import LARGE_RECIPES
from megatron_logra.config.run import RunConfig
from megatron_logra.config.train import TrainConfig
from megatron_logra.data.synthetic import SyntheticConfig
from megatron_logra.data.tokenizer import TokenizerConfig
from megatron_logra.kl.controller import KLConfig
from megatron_logra.models.gpt import ModelConfig
from megatron_logra.optim.config import LograConfig, NativeConfig, OptimizerConfig
from megatron_logra.rewards import TaskConfig
from megatron_logra.rl.config import RLConfig, RolloutConfig, SFTConfig

__all__ = ["RECIPES", "WARM_START_TINY", "tiny", "tiny_adam", "lm_tiny", "lm_tiny_adam"]

WARM_START_TINY = Path(__file__).resolve().parent.parent / "assets" / "warm_start_tiny"
"""The shipped warm start of ``tiny`` (``tools/make_warm_start.py``): model weights and word tokenizer."""


def tiny() -> RunConfig:
    """Main job: tiny GPT, warm start, LoGRA RL with predicted-KL control on reasoning-gym chain_sum (CPU)."""
    shipped = (WARM_START_TINY / "model.safetensors").exists()
    return RunConfig(
        job="rl",
        model=ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=384,
                          vocab_size=160, seq_length=48),
        tokenizer=TokenizerConfig(kind="words", vocab_size=160,
                                  path=str(WARM_START_TINY / "tokenizer") if shipped else ""),
        optimizer=OptimizerConfig(
            # RowAdam at lr 1e-4 with the predicted-KL controller scaling each step; the paper recipe's fixed
            # update ratio learned about half as fast on this model (benchmarks/README.md)
            logra=LograConfig(rank=32, recipe="optimizer", lr=1e-4, weight_decay=0.0, algorithm="row_adam"),
            native=NativeConfig(freeze=True),
        ),
        task=TaskConfig(datasets=["chain_sum"],
                        dataset_kwargs={"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}},
                        num_eval=200),
        rl=RLConfig(steps=60, prompts_per_step=16, group_size=8, micro_batch_size=64, eval_interval=10,
                    prompt_template="{prompt}\n", rollout=RolloutConfig(temperature=1.0, max_new_tokens=6)),
        # a careless teacher (echoes "=" before 60% of its answers, which the verifier rejects) leaves the right
        # answer in the policy's distribution but not its mode; the shipped warm start
        # (tools/make_warm_start.py) replaces this SFT phase when present
        sft=SFTConfig(steps=1500, lr=3e-3, batch_size=64, final_lr_ratio=0.1, teacher="careless_arithmetic",
                      teacher_kwargs={"slip_rate": 0.6, "slip": "echo_equals"},
                      init_path=str(WARM_START_TINY / "model.safetensors") if shipped else ""),
        kl=KLConfig(mode="calibrated", budget_start=2e-3, budget_end=5e-4, horizon=60),
        train=TrainConfig(run_dir="runs/tiny", log_interval=5),
    )


def tiny_adam() -> RunConfig:
    """The main job with dense AdamW (no KL control), for comparison."""
    cfg = tiny()
    cfg.optimizer.name = "adam"
    cfg.optimizer.native = NativeConfig(lr=1e-4)
    cfg.kl.mode = "none"
    cfg.train.run_dir = "runs/tiny-adam"
    return cfg


def lm_tiny() -> RunConfig:
    """Tiny GPT learning a synthetic reverse task with LoGRA (RowAdam, optimizer recipe) in ~1 minute."""
    return RunConfig(
        job="lm",
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192,
                          vocab_size=32, seq_length=32),
        optimizer=OptimizerConfig(logra=LograConfig(rank=16, lr=3e-3, clip_grad=1.0),
                                  native=NativeConfig(lr=3e-3)),
        data=SyntheticConfig(task="reverse", content_length=6, num_symbols=12),
        train=TrainConfig(steps=250, micro_batch_size=16, global_batch_size=32, run_dir="runs/lm-tiny"),
    )


def lm_tiny_adam() -> RunConfig:
    """The lm-tiny recipe with dense AdamW."""
    cfg = lm_tiny()
    cfg.optimizer.name = "adam"
    cfg.train.run_dir = "runs/lm-tiny-adam"
    return cfg


RECIPES: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny, "tiny-adam": tiny_adam, "lm-tiny": lm_tiny, "lm-tiny-adam": lm_tiny_adam,
}

# the GPU recipes of real sizes (qwen2.5-1.5b, qwen2.5-7b, 27b)
RECIPES.update(LARGE_RECIPES)

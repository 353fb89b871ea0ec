"""The documented CPU task-mixture command (docs/usage.md) fits its prompts (it stopped after setup with 'a prompt of 84 tokens does
not fit': gcd prompts are longer than the tiny recipe's 48-token sequences)."""

from __future__ import annotations

import shlex
from pathlib import Path

from megatron_logra.config import parse_args_to_config

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def test_task_mixture_command_fits_its_prompts():
    from megatron_logra.data.tokenizer import load_tokenizer
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.loop import rl_prompt_ids

    (line,) = [ln for ln in USAGE.read_text().splitlines()
               if ln.startswith("megatron-logra train tiny") and "task.datasets=chain_sum,gcd" in ln]
    args = shlex.split(line.split("#", 1)[0])[2:]
    cfg = parse_args_to_config(args[0], args[1:] + ["task.num_eval=16"])
    task = build_task(cfg.task)
    tok = load_tokenizer(cfg.tokenizer.path)
    room = cfg.model.seq_length + 1 - cfg.rl.rollout.max_new_tokens  # rl.loop's bound on a prompt
    problems = task.eval_problems() + [task.train_problem(i) for i in range(64)]
    longest = max(len(rl_prompt_ids(tok, cfg.rl, p.prompt)) for p in problems)
    assert longest <= room, (longest, room)

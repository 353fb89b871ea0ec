"""What the command line accepts: its commands, and the usage that ``-h`` / ``--help`` prints after ``train``,
``eval`` and ``config`` (synopsis, override syntax, every Megatron-LM flag the override parser knows, where the
fields are documented).
"""

from __future__ import annotations

__all__ = ["COMMANDS", "SYNOPSES", "command_help"]

COMMANDS = ("train", "eval", "plot", "config", "recipes", "memory", "convert", "bench")
"""The commands, in the order the usage error for a missing command lists them."""

SYNOPSES = {
    "train": ("megatron-logra train [RECIPE | FILE.yaml] [OVERRIDE ...]\n"
              "       megatron-logra train --resume RUN_DIR [OVERRIDE ...]",
              "Train a recipe (default: tiny, the RL job; `megatron-logra recipes` lists them) or a YAML file (a "
              "partial config whose `recipe: NAME_OR_FILE` names its base), or continue the run in RUN_DIR from its "
              "latest checkpoint (its config.yaml, with the overrides on top; any TP/PP/DP layout). Launch "
              "multi-process runs with `torchrun --nproc-per-node N -m megatron_logra.cli train ...`."),
    "eval": ("megatron-logra eval RUN_DIR [--ckpt-step N] [OVERRIDE ...]",
             "Evaluate the latest checkpoint of RUN_DIR (--ckpt-step N: the one saved at step N, as Megatron-LM's "
             "--ckpt-step) with its config.yaml (overrides on top): held-out accuracy (RL) or loss (lm), printed as "
             "JSON."),
    "config": ("megatron-logra config [RECIPE | FILE.yaml] [OVERRIDE ...]\n"
               "       megatron-logra config --resume RUN_DIR [OVERRIDE ...]",
               "Print the resolved config as YAML (default recipe: tiny): every field with its value, after the "
               "overrides (with model.hf_path, the checkpoint's architecture, as the RL job takes it). First it "
               "runs the checks of `train` that build nothing, each refusing what `train` refuses with the same "
               "error (exit status 2): the fields, the task (reasoning-gym names and task.dataset_kwargs, jsonl: "
               "files, a task.reward plugin's import), the tokenizer (tokenizer.path, or model.hf_path's "
               "config.json and tokenizer files; its size against model.vocab_size), the longest prompt against "
               "model.seq_length, and a resumed run's checkpoint (architecture, steps, saved config). Not "
               "checked: the TP/PP/DP layout against the launch's world size, the memory plan, SGLang's "
               "presence, train.run_dir's state, the model build, the weights and the KL probe."),
}
"""Subcommands that take a recipe and overrides: their synopsis and description (``-h`` / ``--help``)."""


def _metavar(flag: str) -> str:
    """The value a several-field flag's help line shows: ``--load DIR``, ``--loss-scale S``."""
    return "DIR" if flag == "load" else "S"


def command_help(command: str) -> str:
    """Usage of ``train`` / ``eval`` / ``config``: synopsis, override syntax, Megatron-LM flags, fields."""
    import textwrap

    from megatron_logra.megatron_flags import (CHECK_FLAGS, IGNORED_SWITCHES, IGNORED_VALUE_FLAGS, JOB_ALIASES,
                                               LOAD_FLAGS, MEGATRON_ALIASES, MEGATRON_FLAGS, NEUTRAL_FLAGS,
                                               OPTIMIZER_ALIASES, REFUSED_SWITCHES, REFUSED_VALUE_FLAGS,
                                               SCHEDULE_RATIO_FLAGS, STEP_FRACTION_FLAGS, VALUE_MAPS)
    from megatron_logra.megatron_flags.slime import CLIP_FLAGS, SLIME_SAMPLING_FLAGS

    def flags(names) -> str:
        return textwrap.fill(", ".join(f"--{n}" for n in names), width=100, initial_indent="    ",
                             subsequent_indent="    ", break_on_hyphens=False, break_long_words=False)

    synopsis, description = SYNOPSES[command]
    return "\n".join([
        f"usage: {synopsis}",
        "",
        textwrap.fill(description, width=100, break_on_hyphens=False),
        "",
        "overrides (applied in order, then the whole config is validated; a bad value is an error naming the field):",
        "  key=value                   a dotted field: rl.steps=120  optimizer.logra.rank=8  task.datasets=chain_sum,gcd",
        "  --key value | --key=value   the same: --rl.group_size 4  --model.hf_path=/ckpt/Qwen2.5-1.5B",
        "  logra.* / native.*          short for optimizer.logra.* / optimizer.native.*",
        "  schedule.*                  short for optimizer.schedule.* (lr warmup and decay)",
        "  Megatron-LM flags           --tensor-model-parallel-size 2  --seq-length 128  --bf16 (below)",
        *(["  --resume [RUN_DIR]          with RUN_DIR (or --resume=RUN_DIR): continue that run from its latest",
           "                              checkpoint, with its config.yaml and the overrides on top (no RECIPE);",
           "                              bare (a switch, below): train.resume=true for the run in train.run_dir,",
           "                              whose saved config the recipe and overrides must give (launch settings",
           "                              aside: steps, TP/PP/DP, logging, checkpointing); no checkpoint: step 0"]
          if command in ("train", "config") else []),
        "",
        "Megatron-LM and slime flags (each sets one field; slime's --num-rollout, --rollout-batch-size,",
        "  --n-samples-per-prompt, --rollout-max-response-len, ... set the RL job's rl.* fields of that meaning;",
        "  every refused flag of a line is reported in one error):",
        flags(MEGATRON_ALIASES),
        "  by job (rl.* for job=rl, train.* for job=lm; --global-batch-size: lm; with job=rl only a check that it",
        "  equals rl.prompts_per_step × rl.group_size, the sequences of one RL step):",
        flags(JOB_ALIASES),
        "  by optimizer (optimizer.native.* for optimizer.name=adam, else optimizer.logra.* / the non-target AdamW;",
        "  refused where the optimizer would not read them):",
        flags(OPTIMIZER_ALIASES),
        "  absolute lrs of the schedule of the peak lr that --lr sets (after every other override), kept as given:",
        "  --lr-warmup-init -> optimizer.schedule.warmup_init_lr, --min-lr -> optimizer.schedule.min_lr:",
        flags(SCHEDULE_RATIO_FLAGS),
        "  warmup as a fraction of the decay length (--lr-decay-iters, else the job's steps), whole steps only:",
        flags(STEP_FRACTION_FLAGS),
        "  checks only (model.seq_length is --seq-length):",
        flags(CHECK_FLAGS),
        "  values spelt otherwise here: slime's --kl-loss-type (k2 / k3 / low_var_kl -> rl.loss.kl_estimator; k1",
        "  refused), --advantage-estimator grpo, --rm-type math / deepscaler / dapo (task.reward=math_verify),",
        "  --attention-backend (flash / fused: model.transformer_impl=transformer_engine; unfused / local: local):",
        flags(VALUE_MAPS),
        "  slime's PPO clip range (rl.loss.clip_low / clip_high; rl.loss.kind=ppo unless --use-tis chooses tis):",
        flags(CLIP_FLAGS),
        "  slime's dynamic sampling (its nonzero-std filter: rl.dynamic_sampling_rounds, 4 unless given; the",
        "  over-sampling size is checked against rl.prompts_per_step):",
        flags(SLIME_SAMPLING_FLAGS),
        "  switches (no value):",
        flags(MEGATRON_FLAGS),
        *(f"  --{name} {_metavar(name)}: " + " ".join(f"{field}={_metavar(name) if value is None else value}"
                                                     for field, value in fields)
          + (" (a --save naming another directory is refused)" if name == "load" else "")
          for name, fields in LOAD_FLAGS.items()),
        "  accepted and ignored, with a warning saying why (already in effect here):",
        flags([*IGNORED_SWITCHES, *IGNORED_VALUE_FLAGS]),
        "  accepted only at the value this trainer runs (--context-parallel-size 1, --ckpt-format torch_dist, ...):",
        flags(NEUTRAL_FLAGS),
        "  refused, naming what to use instead:",
        flags([*REFUSED_SWITCHES, *REFUSED_VALUE_FLAGS]),
        "",
        "fields:",
        "  megatron-logra config RECIPE [OVERRIDE ...]   every field of a recipe with its value (the resolved config)",
        "  megatron-logra recipes                        the recipes",
        "  Each field is documented in its dataclass (megatron_logra/config/run.py, config/train.py and the configs they compose).",
        "",
    ])

"""The ``train`` section of a run config: :class:`TrainConfig` (the loop, logging, checkpoints, the run
directory, preemption); :class:`~megatron_logra.config.run.RunConfig` composes it with the other sections."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 300
    """Optimizer steps of the lm job (Megatron-LM: --train-iters; with job=rl that flag sets rl.steps)."""
    micro_batch_size: int = 8
    """Sequences per micro-batch per rank, lm job (--micro-batch-size; job=rl: rl.micro_batch_size)."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all DP ranks, lm job (--global-batch-size; a multiple of
    micro_batch_size). RL steps train rl.prompts_per_step × rl.group_size sequences instead."""
    seed: int = 1234
    """Seed of the model init, the parallel RNGs and (RL) the warm start and rollout sampling (--seed), an int in
    [0, 2**31); the data have their own seeds: data.seed (lm job's synthetic task), task.seed / task.eval_seed
    (RL problems), and so do LoGRA's projections and stochastic rounding (optimizer.logra.seed), which --seed
    leaves as they are: vary it too for independent repeats."""
    log_interval: int = 10
    """Steps between log lines (--log-interval). The lm job logs every log_interval steps; the RL job only with
    train.progress=false (with the progress bar on, the bar shows each step instead and this has no effect)."""
    eval_interval: int = 50
    """Steps between held-out evaluations of the lm job; 0 disables (--eval-interval; job=rl: rl.eval_interval)."""
    eval_sequences: int = 64
    """Held-out sequences per evaluation of the lm job: eval sequences ``0 .. eval_sequences - 1``, run in
    micro-batches of micro_batch_size (the last one partly masked) spread over the DP ranks, so the held-out
    loss does not depend on the micro-batch size or the TP / PP / DP layout. 64 is what lm-tiny evaluated
    before this field existed (4 micro-batches of 16)."""
    eval_batches: Optional[int] = None
    """Deprecated (configs saved before train.eval_sequences existed hold it): when set, each evaluation runs
    eval_batches micro-batches, i.e. eval_batches × micro_batch_size sequences, a set that changes with the
    micro-batch size; train.eval_sequences is then not read. Leave it null (train.eval_batches=null) and set
    train.eval_sequences instead: giving train.eval_sequences (an override or a recipe file) while eval_batches
    is set, by the same command or in a resumed run's config, is refused until train.eval_batches=null."""
    save_interval: int = 0
    """Steps between checkpoints; 0 = only at the end (--save-interval)."""
    keep_last: int = 2
    """Checkpoints to keep."""
    checkpoint_checksums: bool = True
    """CRC-32 of every checkpoint file in meta.json, verified on load: detects a shard corrupted at
    the same size; costs about 0.3-0.5 s per GB of each rank's share at save and at load (zlib
    CRC-32). Off: sizes only are checked."""
    memory_check: str = "warn"
    """On a GPU, plan this run's per-GPU memory (the ``megatron-logra memory`` planner) against the
    device's before the model is built: ``warn`` logs the plan and warns when it does not fit,
    ``error`` refuses to start, ``off`` skips it."""
    run_dir: str = "runs/tiny"
    """Output directory: config, metrics.jsonl, checkpoints (--save); must not be empty."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir."""
    overwrite: bool = False
    """Start a new run in a run_dir that already holds one, deleting its checkpoints, metrics and
    summary. Without it such a run_dir is refused (continue it with ``--resume RUN_DIR`` instead)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    exit_signal_handler: bool = False
    """On SIGTERM (a cluster's preemption or time-limit notice; Slurm: ``#SBATCH --signal=TERM@120``),
    finish the step in flight, save its checkpoint on every rank and end normally (exit status 0,
    ``summary.json`` ``stopped``, in the RL and the LM job); after the last step the handler stays until the
    job ends (its checkpoint is saved before the final evaluation, which a SIGTERM during the save skips);
    repeats within 10 s are the same notice, a later SIGTERM ends the process at once (--exit-signal-handler).
    Off, SIGTERM ends the process at once, as torchrun expects when it stops the survivors of a failed rank."""
    exit_duration_minutes: float = 0.0
    """Stop the same way after the first step that ends this many minutes after the job started (set it
    below the scheduler's time limit minus the time a save takes); 0 = no budget (--exit-duration-in-mins)."""
    wandb_project: str = ""
    """Also log every step record (and the config and summary) to this Weights & Biases project from rank 0
    (--wandb-project); empty: no W&B. Needs the wandb package (``pip install wandb``); W&B's environment
    applies (``WANDB_MODE=offline`` on nodes without network, then ``wandb sync``). ``--resume`` continues the
    W&B run whose id ``RUN/wandb_run_id`` holds."""
    wandb_entity: str = ""
    """The W&B team or user the run goes to (--wandb-entity); empty: the logged-in account's default."""
    wandb_exp_name: str = ""
    """The W&B run's name (--wandb-exp-name); empty: the run directory's name."""
    wandb_group: str = ""
    """The W&B group the run joins (slime's --wandb-group), e.g. the runs of one sweep; empty: none."""
    wandb_save_dir: str = ""
    """W&B writes its local files to ``wandb_save_dir/wandb`` (--wandb-save-dir); empty: ``RUN/wandb``. Never
    deleted by a new run in the same run directory (an offline run there may not be synced yet)."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "log_interval", "eval_sequences", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"train.eval_batches={self.eval_batches} must be >= 1 or null (deprecated: leave it null "
                             f"and set train.eval_sequences, the held-out sequences per evaluation)")
        if self.eval_interval < 0 or self.save_interval < 0:
            raise ValueError("train.eval_interval and train.save_interval must be >= 0")
        if not isinstance(self.checkpoint_checksums, bool):
            raise ValueError(f"train.checkpoint_checksums={self.checkpoint_checksums!r} must be true or false")
        if self.memory_check not in ("off", "warn", "error"):
            raise ValueError(f"train.memory_check={self.memory_check!r}: choose off, warn or error")
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            raise ValueError(f"train.run_dir={self.run_dir!r} is empty: the run would write its checkpoints, metrics "
                             f"and config.yaml into the working directory (and train.overwrite=true would delete "
                             f"them there); name a directory, e.g. train.run_dir=runs/my-run")
        if not isinstance(self.exit_signal_handler, bool):
            raise ValueError(f"train.exit_signal_handler={self.exit_signal_handler!r} must be true or false")
        if isinstance(self.exit_duration_minutes, bool) or not isinstance(self.exit_duration_minutes, (int, float)) \
                or not math.isfinite(self.exit_duration_minutes) or self.exit_duration_minutes < 0:
            raise ValueError(f"train.exit_duration_minutes={self.exit_duration_minutes!r} must be a finite number of "
                             "minutes >= 0 (0 = no budget)")
        for name in ("wandb_project", "wandb_entity", "wandb_exp_name", "wandb_group", "wandb_save_dir"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"train.{name}={getattr(self, name)!r} must be a string")
        if self.wandb_project and any(c in self.wandb_project for c in "/\\#?%:"):
            raise ValueError(f"train.wandb_project={self.wandb_project!r}: W&B project names cannot hold / \\ # ? % "
                             "or :; give the team in train.wandb_entity and the project alone")
        given = [f"train.{name}" for name in ("wandb_entity", "wandb_exp_name", "wandb_group", "wandb_save_dir")
                 if getattr(self, name)]
        if given and not self.wandb_project:
            raise ValueError(f"{', '.join(given)} set without train.wandb_project: name the W&B project "
                             "(--wandb-project NAME) to log to W&B, or leave them empty")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise ValueError(f"train.seed={self.seed!r} must be an int in [0, 2**31) (the seeds derived from it, "
                             "SGLang's among them, are 32-bit); choose e.g. train.seed=1234")

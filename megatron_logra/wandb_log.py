"""Weights & Biases logging of a run's step records, as Megatron-LM's ``--wandb-project`` gives it.

With ``train.wandb_project`` set, rank 0 logs every record :class:`~megatron_logra.metrics.MetricsWriter`
writes to ``metrics.jsonl`` (numbers, flags as 0/1, ``skip_reason`` as a string) to one W&B run, its config
the run's resolved config (credentials redacted, as ``config.yaml``), and at the end the run's summary.

Contracts:

* **One W&B run per run directory.** Its id is kept in ``RUN/wandb_run_id``; ``--resume`` continues that W&B
  run (``resume="allow"``), a new run (also ``train.overwrite=true``) starts another. Records are plotted
  against their ``step`` field (``define_metric``), not W&B's own counter, so a resume from a checkpoint
  before the last logged step logs the replayed steps again under the same step numbers (W&B cannot drop
  points; ``metrics.jsonl`` and TensorBoard do).
* **W&B's own files** go to ``train.wandb_save_dir/wandb`` (default ``RUN/wandb``) and are never deleted by the
  trainer: a new run in the same directory keeps an earlier offline run there until it is synced
  (``wandb sync``).
* **Offline clusters**: W&B's own environment variables apply (``WANDB_MODE=offline``, ``WANDB_API_KEY``,
  ``WANDB_BASE_URL``); nothing here reads them.
* A missing ``wandb`` package is refused before the job builds anything (:func:`check_wandb`); a failing
  ``wandb.init`` (no credentials, no network in online mode) is a ``ValueError`` naming the project and the
  offline mode, on rank 0 as the job starts.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["WANDB_ID_FILE", "WandbOptions", "WandbRun", "check_wandb", "wandb_options"]

WANDB_ID_FILE = "wandb_run_id"
"""The file in the run directory holding the id of the run's W&B run, which ``--resume`` continues."""

_ID_CHARS = string.ascii_lowercase + string.digits

TEXT_FIELDS = ("skip_reason",)
"""String fields of a record that W&B gets (other strings, such as ``sync_mode``, stay in ``metrics.jsonl``)."""


@dataclass
class WandbOptions:
    """What the W&B run is: where it goes and what its config is."""

    project: str
    """The W&B project (train.wandb_project)."""
    entity: str = ""
    """The W&B team or user (train.wandb_entity); empty: the account's default."""
    name: str = ""
    """The run's display name (train.wandb_exp_name); empty: the run directory's name."""
    save_dir: str = ""
    """W&B's local files go to ``save_dir/wandb`` (train.wandb_save_dir); empty: the run directory."""
    group: str = ""
    """The W&B group of the run (train.wandb_group); empty: none."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's resolved config, credentials redacted (what ``config.yaml`` holds)."""


def check_wandb(train_cfg: Any) -> None:
    """``ValueError`` naming ``train.wandb_project`` when W&B logging is asked for and the ``wandb`` package is
    not installed. Imports nothing, so it costs nothing where W&B is off."""
    if train_cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"train.wandb_project={train_cfg.wandb_project!r} needs the wandb package, which is not "
                         "installed: pip install wandb (or pip install 'megatron_logra[wandb]'), or leave "
                         "train.wandb_project empty")


def wandb_options(train_cfg: Any, config: dict[str, Any]) -> Optional[WandbOptions]:
    """The :class:`WandbOptions` of ``train_cfg`` (a ``TrainConfig``) with ``config`` as the W&B config; None
    without ``train.wandb_project``."""
    if not train_cfg.wandb_project:
        return None
    return WandbOptions(project=train_cfg.wandb_project, entity=train_cfg.wandb_entity,
                        name=train_cfg.wandb_exp_name, save_dir=train_cfg.wandb_save_dir, config=config,
                        group=train_cfg.wandb_group)


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


class WandbRun:
    """The W&B run of a run directory (rank 0 only; see the module doc for resume and files)."""

    def __init__(self, run_dir: Path, options: WandbOptions, *, resume: bool) -> None:
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))  # W&B's own id form
            tmp = id_file.with_name(id_file.name + ".tmp")
            tmp.write_text(run_id + "\n")
            os.replace(tmp, id_file)
        save_dir = Path(options.save_dir) if options.save_dir else run_dir  # W&B writes into DIR/wandb
        save_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=options.project, entity=options.entity or None,
                                  name=options.name or run_dir.resolve().name, dir=str(save_dir),
                                  config=options.config, id=run_id, resume="allow",
                                  group=options.group or None)
        except Exception as exc:  # noqa: BLE001 - W&B raises its own types (UsageError, CommError, ...)
            raise ValueError(f"train.wandb_project={options.project!r}: W&B could not start its run "
                             f"({type(exc).__name__}: {exc}); log in (wandb login, or WANDB_API_KEY), or log "
                             "offline with WANDB_MODE=offline and upload later with wandb sync") from exc
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        logger.info("logging to W&B: project %s, run %s (id %s), files under %s", options.project,
                    self.run.name, run_id, save_dir / "wandb")

    def log(self, record: dict[str, Any]) -> None:
        """Log one step record: its numbers and flags (as 0/1), and the strings of :data:`TEXT_FIELDS`."""
        values: dict[str, Any] = {}
        for key, value in record.items():
            number = _number(value)
            if number is not None:
                values[key] = number
            elif isinstance(value, str) and key in TEXT_FIELDS:
                values[key] = value
        self.run.log(values)

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """Log ``rows`` (dicts with the same keys) as a W&B table ``name`` at ``step`` (the generations a run logs,
        as verl's validation generations table)."""
        import wandb

        columns = list(rows[0])
        self.run.log({"step": step, name: wandb.Table(columns=columns, data=[[row.get(c) for c in columns]
                                                                              for row in rows])})

    def close(self, summary: Optional[dict[str, Any]] = None, exit_code: int = 0) -> None:
        """Put the numbers and strings of ``summary`` (the run's ``summary.json``) into the W&B run's summary,
        then finish the run (it waits for an online upload); a nonzero ``exit_code`` marks it failed."""
        if summary:
            for key, value in summary.items():
                if _number(value) is not None or isinstance(value, str):
                    self.run.summary[key] = _number(value) if _number(value) is not None else value
        self.run.finish(exit_code=exit_code)

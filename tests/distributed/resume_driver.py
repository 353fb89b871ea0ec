"""Several training runs and file operations in one process (or one torchrun launch).

Used by ``test_resume.py`` to save process start-ups (each costs ~10 s of imports on 2 cores)::

    python resume_driver.py OUT.json '[["run", "label", [cli args...]], ["copy", src, dst], ...]'

Operations, in order:

* ``["run", label, argv]``: ``run_lm`` on the config the CLI would build from ``argv`` (``train
  ...``). The default process group is kept between runs (as the equivalence worker does);
  ``initialize_parallel`` rebuilds megatron's groups and re-seeds the default generator and the
  tensor-parallel RNG tracker, i.e. a run starts as in a fresh process. A failure aborts.
* ``["cli", label, argv]``: ``megatron_logra.cli.main(argv)`` — the CLI's entry point, which tears
  the process group down afterwards (1-process launches only); an exception is recorded.
* ``["copy", src, dst]`` / ``["truncate", path]`` / ``["unlink", path]`` / ``["write", path, text]``:
  file operations, done by global rank 0 between barriers.

Rank 0 writes ``{label: {"summary": ..., "error": [type, message] | null}}`` to OUT.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def main() -> int:
    out_path, ops = sys.argv[1], json.loads(sys.argv[2])
    from megatron_logra.cli import main as cli_main
    from megatron_logra.cli.train import split_recipe
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.train.lm import run_lm

    results: dict = {}
    for op in ops:
        kind = op[0]
        if kind == "run":
            _, label, argv = op
            assert argv[0] == "train", argv
            recipe, overrides = split_recipe(argv[1:])
            cfg = parse_args_to_config(recipe, overrides)
            assert cfg.job == "lm", f"run operations train the LM job, got job={cfg.job!r}"
            try:
                results[label] = {"summary": run_lm(cfg), "error": None}
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)  # peers may wait in a collective: let torchrun tear the launch down
        elif kind == "cli":
            _, label, argv = op
            os.environ["MEGATRON_LOGRA_TRACEBACK"] = "1"  # the error itself, not the CLI's exit-2 report of it
            try:
                cli_main(argv)
                results[label] = {"summary": None, "error": None}
            except Exception as exc:  # expected: a damaged checkpoint
                results[label] = {"summary": None, "error": [type(exc).__name__, str(exc)]}
        else:
            _barrier()
            if _rank0():
                if kind == "copy":
                    shutil.copytree(op[1], op[2])
                elif kind == "truncate":
                    data = Path(op[1]).read_bytes()
                    Path(op[1]).write_bytes(data[: len(data) // 2])
                elif kind == "unlink":
                    Path(op[1]).unlink()
                elif kind == "write":
                    Path(op[1]).write_text(op[2])
                else:
                    raise ValueError(f"unknown operation {op!r}")
            _barrier()
    if _rank0():
        Path(out_path).write_text(json.dumps(results, indent=1))
    from megatron_logra.parallel import destroy_parallel

    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``sync.transport=directory`` at TP 2: which ranks write the refits' full weights (``sync.full_weights``).

``first_rank`` (the default): one file for the job, in rank 0's directory; rank 1's anchor marker names it as
``../rank0/full_<version>.safetensors`` and a separate engine following rank 1's directory reloads it from
there and follows rank 1's deltas. ``none``: no full-weights file, markers without one."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed


def _run(launcher, tmp_path, *extra):
    run = tmp_path / "tp2dir"
    args = ["-m", "megatron_logra.cli", "train", "tiny", "--tensor-model-parallel-size", "2", "rl.steps=2",
            "kl.mode=none", f"train.run_dir={run}", "train.progress=false", "rl.prompts_per_step=4", "rl.group_size=4",
            "rl.eval_interval=0", "task.num_eval=8", "sync.check_interval=1", "sync.anchor_interval=0",
            "sync.transport=directory", *extra]
    launcher.launch(2, args, timeout=400, log=tmp_path / "tp2dir.log")
    from megatron_logra.sync import DirectoryTransport

    return [DirectoryTransport(run / "deltas" / f"rank{r}") for r in (0, 1)]


class _HF:
    """Parameters under HF names, as a ModuleEngine's model (``named_parameters`` is all it reads)."""

    def __init__(self, state):
        import torch

        self._params = {n: torch.nn.Parameter(torch.zeros_like(t), requires_grad=False) for n, t in state.items()}

    def named_parameters(self, *args, **kwargs):
        yield from self._params.items()


def test_first_rank_writes_one_file_that_every_ranks_marker_names(launcher, tmp_path):
    from safetensors.torch import load_file

    from megatron_logra.sync import ModuleEngine

    ranks = _run(launcher, tmp_path)
    assert [t.full_files() for t in ranks] == [[0], []]
    markers = [json.loads((t.dir / "anchor_00000000.json").read_text()) for t in ranks]
    assert markers[0]["full"]["file"] == "full_00000000.safetensors"
    assert markers[1]["full"] == {"file": "../rank0/full_00000000.safetensors", "sha256": markers[0]["full"]["sha256"]}
    assert markers[0]["fingerprint"] == markers[1]["fingerprint"]
    engine = ModuleEngine(_HF(load_file(str(ranks[0].dir / "full_00000000.safetensors"))))
    ranks[1].load_full(engine)
    assert engine.weight_version == 0 and ranks[1].consume(engine) == ranks[1].versions()


def test_none_writes_no_file(launcher, tmp_path):
    ranks = _run(launcher, tmp_path, "sync.full_weights=none")
    assert [t.full_files() for t in ranks] == [[], []]
    assert all("full" not in a for t in ranks for a in t.anchors())
    assert [a["version"] for a in ranks[1].anchors()] == [0]

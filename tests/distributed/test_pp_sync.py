"""Sketch-delta sync under pipeline parallelism (2 stages): the per-stage parts are gathered and
merged, every rank's engine takes the whole delta, and the engine's fingerprint equals the
trainer's after every update (``sync.check_interval=1``: a mismatch would force a full refit and
show as ``sync_drift=1`` / ``sync_mode="delta+anchor"``).

With tied word embeddings the last stage holds its own copy of the embedding as
``output_layer.weight``; a tied engine has no ``lm_head``, so that copy must neither be refit
nor travel in a delta (the first stage's embedding stands for both). The tied run also trains
the non-target parameters, so the embedding travels dense in every delta."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("extra", [[], ["model.untie_embeddings_and_output_weights=false", "native.freeze=false"]],
                         ids=["untied", "tied-trained-embeddings"])
def test_rl_delta_sync_with_two_pipeline_stages(launcher, tmp_path, extra):
    run = tmp_path / "pp2"
    args = ["-m", "megatron_logra.cli", "train", "tiny", "--pipeline-model-parallel-size", "2", "rl.steps=3",
            "kl.mode=none", f"train.run_dir={run}", "train.progress=false", "rl.prompts_per_step=4", "rl.group_size=4",
            "rl.eval_interval=0", "task.num_eval=8", "sync.check_interval=1", "sync.anchor_interval=0", *extra]
    launcher.launch(2, args, timeout=400, log=tmp_path / "pp2.log")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    applied = [r for r in records if not r["skipped"]]  # a step whose advantages are all 0 is skipped
    assert len(applied) >= 2, records
    for r in applied:
        assert (r["sync_mode"], r["sync_drift"]) == ("delta", 0), r
    # a delta carries U (rows x rank) per target, far less than the model's bf16 bytes
    from megatron_logra.config import parse_args_to_config

    model = parse_args_to_config("tiny", []).model
    assert all(0 < r["sync_bytes"] < 2 * model.num_params() for r in applied)


def test_directory_transport_writes_the_full_weights_of_both_stages(launcher, tmp_path):
    """``sync.transport=directory`` at PP 2 with ``sync.full_weights=all``: each rank's chain holds the start
    refit's full weights (every HF tensor of both stages, laid out before the stream from the stages' exchanged
    parameter lists), the same file on both ranks (why one file, rank 0's, serves every rank by default), and a
    separate engine loads it and follows the deltas."""
    run = tmp_path / "pp2dir"
    args = ["-m", "megatron_logra.cli", "train", "tiny", "--pipeline-model-parallel-size", "2", "rl.steps=2",
            "kl.mode=none", f"train.run_dir={run}", "train.progress=false", "rl.prompts_per_step=4", "rl.group_size=4",
            "rl.eval_interval=0", "task.num_eval=8", "sync.check_interval=1", "sync.anchor_interval=0",
            "sync.transport=directory", "sync.full_weights=all"]
    launcher.launch(2, args, timeout=400, log=tmp_path / "pp2dir.log")
    import torch
    from safetensors.torch import load_file

    from megatron_logra.sync import DirectoryTransport, ModuleEngine

    full = [DirectoryTransport(run / "deltas" / f"rank{r}") for r in (0, 1)]
    assert [t.full_files() for t in full] == [[0], [0]]
    files = [(t.dir / "full_00000000.safetensors").read_bytes() for t in full]
    assert files[0] == files[1]
    weights = load_file(str(full[0].dir / "full_00000000.safetensors"))
    assert any(".layers.0." in n for n in weights) and any(n.startswith("lm_head") for n in weights)

    class _HF(torch.nn.Module):
        def __init__(self, state):
            super().__init__()
            for i, (n, t) in enumerate(state.items()):
                self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
            self._names = list(state)

        def named_parameters(self, *args, **kwargs):
            for i, name in enumerate(self._names):
                yield name, getattr(self, f"p{i}")

    engine = ModuleEngine(_HF(weights))
    full[0].load_full(engine)
    assert engine.weight_version == 0 and full[0].consume(engine) == full[0].versions()

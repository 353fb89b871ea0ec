"""RL updates of the default recipe whose first sketch delta fails part-way through the embedded engine's commit
(an in-place kernel error after the first weights were written; here a weight the kernels cannot write in place,
an expanded view whose rows share memory, for that one apply). The engine reports ``weight_version = -1`` and
refuses the same delta again instead of merging it a second time; policy sync answers the failure with a full
refit, after which the engine holds weights bitwise equal to the trainer's (its full tensors streamed by
``rl.weights.iter_hf_params``, in the engine's dtype) and the following updates travel as deltas again, each
leaving the engine bitwise equal to the trainer. The drift check is off: only the failure's refit can repair."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_logra.sync import SyncError

from support.engine_weights import engine_differs_from_trainer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

MAX_UPDATES = 8


@pytest.fixture(scope="module", autouse=True)
def _two_threads(two_threads):
    yield


@pytest.mark.parametrize("transport", ["inprocess", "directory"])
def test_a_delta_whose_commit_fails_part_way_is_not_applied_twice_and_a_refit_recovers(tmp_path, transport):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import rl_update

    cfg = parse_args_to_config("tiny", [
        f"train.run_dir={tmp_path / 'run'}", "train.progress=false", f"rl.steps={MAX_UPDATES}",
        "task.num_eval=8", "rl.eval_interval=0", "sync.check_interval=0", f"sync.transport={transport}",
    ])
    assert cfg.sync.mode == "delta" and cfg.rl.rollout.engine == "embedded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    try:
        engine = comps.engine
        params = dict(engine.model.named_parameters())
        broken = f"model.layers.{cfg.model.num_layers - 1}.mlp.down_proj.weight"  # the last weight a commit writes
        real_apply = engine.apply_sketch_delta
        faults: list[dict] = []

        def apply_failing_once(delta):
            if faults:
                return real_apply(delta)
            before = {n: p.detach().clone() for n, p in params.items()}
            own = params[broken].data
            params[broken].data = own[:1].expand_as(own)  # in-place kernels refuse to write it
            try:
                return real_apply(delta)
            except SyncError as exc:
                params[broken].data = own  # the kernel error is gone; the weights stay as the commit left them
                fault = {"error": exc, "version": engine.weight_version,
                         "written": [n for n, p in params.items() if not torch.equal(p.detach(), before[n])]}
                faults.append(fault)
                once = {n: p.detach().clone() for n, p in params.items()}
                try:  # the same delta again, before the refit: refused, nothing merged a second time
                    real_apply(delta)
                except SyncError as again:
                    fault["retry"] = again.kind
                fault["retry_unchanged"] = all(torch.equal(p.detach(), once[n]) for n, p in params.items())
                fault["retry_version"] = engine.weight_version
                raise
            finally:
                params[broken].data = own

        engine.apply_sketch_delta = apply_failing_once
        assert engine_differs_from_trainer(comps) == []
        records = []
        while len(records) < MAX_UPDATES and not (faults and any(r["sync_mode"] == "delta" for r in records)):
            record = rl_update(comps, state)
            records.append(record)
            assert engine.weight_version == state.weight_version, record
            assert engine_differs_from_trainer(comps) == [], f"update {state.step} ({record['sync_mode']})"
    finally:
        destroy_parallel()

    assert len(faults) == 1, f"no delta reached the engine in {len(records)} updates"
    fault = faults[0]
    assert fault["error"].kind == "apply" and "partially written" in str(fault["error"])
    assert fault["written"] and broken not in fault["written"], "the commit wrote some weights before it failed"
    assert fault["version"] == -1
    assert fault.get("retry") == "gap" and fault["retry_unchanged"] and fault["retry_version"] == -1
    failed = next(i for i, r in enumerate(records) if r["sync_mode"] != "delta" and not r["skipped"])
    assert records[failed]["sync_mode"] == "full" and records[failed]["sync_drift"] == 1
    assert [r["sync_mode"] for r in records[failed + 1:] if not r["skipped"]][-1] == "delta"

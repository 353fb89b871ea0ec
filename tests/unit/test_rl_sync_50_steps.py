"""50 RL updates of the default recipe (``megatron-logra train``) with sketch-delta sync.

Two properties, checked after every update against independent references:

* the engine that receives only sketch deltas holds weights bitwise equal to the trainer's
  compute weights (the trainer's full tensors streamed by ``rl.weights.iter_hf_params``, in the
  engine's dtype) -- with the drift check switched off, so no full refit can repair a bad delta;
* the rollouts every update trains on are identical (token ids, log-probs, finish flags) to the
  ones a second engine produces with the same prompts and seeds after a full dense refit of
  the trainer's weights before each update: a run with full refits samples the same data.

The recipe is the shipped one (warm start, rank 32, predicted-KL control); only the run
directory, progress bar, evaluation set and drift check are changed.
"""

from __future__ import annotations

import warnings

import pytest

from support.engine_weights import engine_differs_from_trainer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

NUM_UPDATES = 50


@pytest.fixture(scope="module", autouse=True)
def _two_threads(two_threads):
    yield


def test_50_updates_keep_the_delta_engine_bitwise_equal_and_rollouts_equal_to_full_refits(tmp_path):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import rl_update
    from megatron_logra.rl.weights import iter_hf_params
    from megatron_logra.rollout.embedded import EmbeddedEngine

    cfg = parse_args_to_config("tiny", [
        f"train.run_dir={tmp_path / 'run'}", "train.progress=false", f"rl.steps={NUM_UPDATES}",
        "task.num_eval=8", "rl.eval_interval=0", "sync.check_interval=0",
    ])
    assert cfg.sync.mode == "delta" and cfg.rl.rollout.engine == "embedded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    try:
        reference = EmbeddedEngine(cfg.model, init_seed=cfg.train.seed + 1, tp=comps.groups.tp_size,
                                   dtype=cfg.model.torch_dtype)

        def refit_reference() -> None:
            reference.update_weights_full(iter_hf_params(comps.model, comps.groups, cfg.model),
                                          comps.engine.weight_version)

        refit_reference()
        assert engine_differs_from_trainer(comps) == []
        delta_generate = comps.engine.generate
        compared = []

        def generate_and_compare(prompts, params):
            ours = delta_generate(prompts, params)
            theirs = reference.generate(prompts, params)
            assert len(ours) == len(theirs) == len(prompts)
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert a.completion_ids == b.completion_ids, (state.step, i)
                assert a.logprobs == b.logprobs, (state.step, i)  # exact floats
                assert a.finished == b.finished and a.weight_version == b.weight_version, (state.step, i)
            compared.append(len(ours))
            return ours

        comps.engine.generate = generate_and_compare
        modes, sync_bytes = [], []
        weights_before = {t.key: t.weight.detach().clone() for t in comps.optimizer.targets}
        for _ in range(NUM_UPDATES):
            record = rl_update(comps, state)
            if not record["skipped"]:
                modes.append(record["sync_mode"])
                sync_bytes.append(record["sync_bytes"])
            assert comps.engine.weight_version == state.weight_version
            assert engine_differs_from_trainer(comps) == [], f"update {state.step}"
            refit_reference()
    finally:
        destroy_parallel()

    assert state.step == NUM_UPDATES and len(compared) == NUM_UPDATES
    assert all(n == cfg.rl.prompts_per_step * cfg.rl.group_size for n in compared)
    # most updates really change the policy, and every one of them travelled as a delta alone
    assert len(modes) >= NUM_UPDATES * 0.8, f"only {len(modes)} of {NUM_UPDATES} updates were applied"
    assert set(modes) == {"delta"}, modes
    full_bf16 = sum(p.numel() * 2 for p in reference.model.parameters())
    assert max(sync_bytes) < 0.5 * full_bf16
    moved = sum((t.weight.detach() - weights_before[t.key]).norm().item() for t in comps.optimizer.targets)
    assert moved > 0

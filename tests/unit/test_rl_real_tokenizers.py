"""RL with the tokenizer conventions of real checkpoints.

Qwen's tokenizers have no BOS token (prompts start with their text) and Instruct checkpoints list
more stop ids in ``generation_config.json`` than their tokenizer's EOS (rollouts stop on all of
them). The job's own tokenizer is rebuilt without BOS and given an extra stop id; an RL update and
an evaluation run, and every generation request carries the full stop list and BOS-less prompts.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from test_rl_e2e import alternating_score, small_cfg


def test_rl_with_a_tokenizer_without_bos_and_generation_config_stop_ids(tmp_path):
    """Qwen's tokenizers have no BOS token and Instruct checkpoints stop on more ids than the
    tokenizer's EOS: prompts start with the text, and rollouts stop on every listed id."""
    import json

    from megatron_logra.data.tokenizer import build_tokenizer
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.components import build_components
    from megatron_logra.rl.loop import evaluate_accuracy, rl_update

    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    cfg = small_cfg(tmp_path / "run", f"tokenizer.path={tok_dir}", "rl.steps=1")
    task = build_task(cfg.task)
    texts = [task.train_problem(i).prompt + " " + task.train_problem(i).answer for i in range(64)]
    tok = build_tokenizer(dataclasses.replace(cfg.tokenizer, path=""), texts)  # what the job builds by default
    bos_id = tok.bos_token_id
    tok.bos_token = None
    tok.save_pretrained(str(tok_dir))
    extra_stop = tok.pad_token_id + 3
    assert extra_stop not in (tok.eos_token_id, tok.pad_token_id)
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, extra_stop]}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comps, state, _ = build_components(cfg)
    try:
        assert comps.tokenizer.bos_token_id is None
        assert comps.stop_token_ids() == sorted({tok.eos_token_id, extra_stop})
        seen = []
        generate = comps.engine.generate

        def spy(prompts, params):
            seen.append((prompts, params))
            return generate(prompts, params)

        comps.engine.generate = spy
        comps.task.score = alternating_score()
        rec = rl_update(comps, state)
        assert math.isfinite(evaluate_accuracy(comps)) and not rec.get("skipped")
        for prompts, params in seen:
            assert sorted(params.stop_token_ids) == comps.stop_token_ids()
            assert all(p and None not in p for p in prompts)
            assert all(p[0] != bos_id for p in prompts)  # the text itself, no BOS
    finally:
        destroy_parallel()

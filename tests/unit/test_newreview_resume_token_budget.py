"""``rl.max_tokens_per_micro_batch`` splits a step into micro-batches as ``rl.micro_batch_size`` does (the same
update up to the order of float sums), so a bare ``--resume`` with a recipe may change it as it may change
``rl.micro_batch_size`` and the layout (a run moved to pipeline parallelism needs it 0); the objective may not
change."""

from __future__ import annotations


def test_the_token_budget_is_a_launch_setting_of_a_recipe_resume():
    from megatron_logra.cli import resume_differences
    from megatron_logra.config import parse_args_to_config, to_dict

    saved = to_dict(parse_args_to_config("tiny", ["rl.max_tokens_per_micro_batch=512"]))
    for budget in ("0", "2048"):
        cfg = parse_args_to_config("tiny", [f"rl.max_tokens_per_micro_batch={budget}", "train.resume=true"])
        assert resume_differences(saved, cfg) == []
    cfg = parse_args_to_config("tiny", ["rl.max_tokens_per_micro_batch=0", "rl.loss.kind=gspo"])
    assert [name for name, _, _ in resume_differences(saved, cfg)] == ["rl.loss.kind"]

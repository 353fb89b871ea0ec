"""slime's list flags (``--rollout-stop``, ``--rollout-stop-token-ids``) take every following word up to the next
``--flag`` or ``key=value``; a recipe named after them (the recipe goes first) is refused, naming the flag and the
fix, instead of being taken as one more value while the default recipe runs."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from megatron_logra.cli.train import split_recipe
from megatron_logra.config import parse_args_to_config
from megatron_logra.config.recipes import RECIPES


def _config(args: list[str]):
    recipe, overrides = split_recipe(args)  # as `megatron-logra train ARGS` splits them
    return parse_args_to_config(recipe, overrides)


@pytest.mark.parametrize("recipe", ["qwen2.5-1.5b", "tiny-adam"])
def test_a_recipe_after_the_stop_strings_is_refused(recipe):
    assert recipe in RECIPES
    with pytest.raises(ValueError, match=rf"--rollout-stop.*{re.escape(recipe)}.*recipe.*first"):
        _config(["--rollout-stop", "</answer>", recipe])


def test_a_recipe_file_after_the_stop_strings_is_refused(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("recipe: tiny\nrl:\n  steps: 3\n")
    with pytest.raises(ValueError, match=r"--rollout-stop.*mine\.yaml.*recipe.*first"):
        _config(["--rollout-stop", "</answer>", str(path)])


def test_the_recipe_first_and_other_words_still_work(tmp_path):
    cfg = _config(["tiny-adam", "--rollout-stop", "</answer>", "Question:", "rl.steps=2"])
    assert cfg.rl.rollout.stop == ["</answer>", "Question:"] and cfg.rl.steps == 2
    assert cfg.optimizer.name == RECIPES["tiny-adam"]().optimizer.name
    # a word naming a recipe is a value in the --flag=VALUE form, and as the flag's first word
    assert _config(["--rollout-stop=tiny"]).rl.rollout.stop == ["tiny"]
    assert _config(["tiny", "--rollout-stop", "tiny"]).rl.rollout.stop == ["tiny"]
    # a word that is no recipe name or recipe file is a stop string, as before
    assert _config(["--rollout-stop", "a", "tiny.yaml"]).rl.rollout.stop == ["a", "tiny.yaml"]


def test_the_command_line_reports_it():
    out = subprocess.run([sys.executable, "-m", "megatron_logra.cli", "config", "--rollout-stop", "</answer>",
                          "qwen2.5-1.5b"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "qwen2.5-1.5b" in out.stderr and "first" in out.stderr, out.stderr[-2000:]

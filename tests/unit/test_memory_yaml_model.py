"""``megatron-logra memory --model RECIPE.yaml`` says that a YAML recipe is not a model (it used to report the
file as invalid JSON, as if it were a broken config.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.memory.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny.yaml", "run.YML"])
def test_a_yaml_recipe_given_as_the_model_is_named_as_one(tmp_path, capsys, name):
    path = ROOT / "examples" / "tiny.yaml" if name == "tiny.yaml" else tmp_path / name
    if not path.exists():
        path.write_text("recipe: tiny\n")
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(path), "--tp", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is a YAML file, not a model" in err and "config.json" in err and "not valid JSON" not in err, err

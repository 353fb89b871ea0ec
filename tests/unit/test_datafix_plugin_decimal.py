"""A ``task.reward`` plugin may return any finite real number in ``[0, 1]``: a ``decimal.Decimal`` (which is no
``numbers.Real``) as a ``fractions.Fraction`` or a float; NaN, infinite or out-of-range ones, complex numbers and
strings (``"1"``, ``"True"``) are still refused naming the plugin and the value."""

from __future__ import annotations

import json
import uuid

import pytest

from megatron_logra.rewards import PluginScorer, Problem, TaskConfig, build_task

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

PLUGIN = '''
from decimal import Decimal
from fractions import Fraction
import numpy as np

VALUES = {
    "dec_half": Decimal("0.5"), "dec_quarter": Decimal("0.25"), "dec_one": Decimal("1"), "dec_zero": Decimal("0"),
    "dec_one_point_zero": Decimal("1.000"), "dec_negative_zero": Decimal("-0"), "dec_tiny": Decimal("1E-30"),
    "frac_third": Fraction(1, 3), "frac_one": Fraction(4, 4),
    "dec_nan": Decimal("NaN"), "dec_snan": Decimal("sNaN"), "dec_inf": Decimal("Infinity"),
    "dec_negative": Decimal("-0.5"), "dec_over": Decimal("1.5"), "dec_huge": Decimal("1E+400"),
    "frac_over": Fraction(3, 2), "complex_half": complex(0.5, 0), "np_complex": np.complex128(0.5),
    "str_one": "1", "str_true": "True", "str_dec": "0.5", "nan": float("nan"),
}


def __getattr__(name):
    value = VALUES[name]
    return lambda problem, completion: value
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    name = f"mlogra_datafix_decimal_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


PROBLEM = Problem("What is 1 + 1?", "2", "jsonl:x.jsonl", {})


@pytest.mark.parametrize("fn, expected", [
    ("dec_half", 1 / 2), ("dec_quarter", 1 / 4), ("dec_one", 1.0), ("dec_zero", 0.0), ("dec_one_point_zero", 1.0),
    ("dec_negative_zero", 0.0), ("dec_tiny", 1e-30), ("frac_third", 1 / 3), ("frac_one", 1.0),
])
def test_a_decimal_or_fraction_in_range_is_its_score(plugin, fn, expected):
    score = PluginScorer(f"{plugin}:{fn}").score(PROBLEM, "2")
    assert type(score) is float and score == expected


@pytest.mark.parametrize("fn, shown", [
    ("dec_nan", "Decimal('NaN')"), ("dec_snan", "Decimal('sNaN')"), ("dec_inf", "Decimal('Infinity')"),
    ("dec_negative", "Decimal('-0.5')"), ("dec_over", "Decimal('1.5')"), ("dec_huge", "Decimal('1E+400')"),
    ("frac_over", "returned 1.5"), ("complex_half", "(0.5+0j)"), ("np_complex", "0.5+0j"),
    ("str_one", "returned '1' (str)"), ("str_true", "returned 'True' (str)"), ("str_dec", "returned '0.5' (str)"),
    ("nan", "returned nan"),
])
def test_other_values_are_still_refused_naming_the_plugin_and_the_value(plugin, fn, shown):
    with pytest.raises(ValueError) as err:
        PluginScorer(f"{plugin}:{fn}").score(PROBLEM, "2")
    message = str(err.value)
    assert f"{plugin}:{fn}" in message and "expected a number in [0, 1]" in message, message
    assert shown in message, message
    assert "returned inf" not in message, message


def test_a_decimal_score_earns_the_graded_reward(plugin, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(20)))
    task = build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=f"{plugin}:dec_quarter", num_eval=0,
                                 correct_reward=1.0, wrong_reward=-0.2))
    reward, correct = task.score(task.sources[0].problems[0], "1")
    assert correct is False and reward == pytest.approx(-0.2 + 0.25 * (1.0 - -0.2))
    task = build_task(TaskConfig(datasets=[f"jsonl:{data}"], reward=f"{plugin}:dec_one", num_eval=0))
    assert task.score(task.sources[0].problems[0], "1") == (1.0, True)

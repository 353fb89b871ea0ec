"""Demonstration teachers for the supervised warm start.

A teacher maps a training problem to the answer text the warm start imitates:
``teacher(problem, index) -> str``. The default, ``reference``, is the dataset's own answer.

``careless_arithmetic`` imitates a weak teacher with one systematic slip in a share
``slip_rate`` of its demonstrations: it echoes the equals sign before the answer (``= 5``, which
the verifier does not accept as an answer; slip ``echo_equals``), drops the carry into the tens
(``7 + 8 + 6`` -> ``1``, slip ``drop_tens``) or reads every minus sign as a plus
(``7 - 8 + 6`` -> ``21``, slip ``minus_as_plus``). A policy warm-started on it already holds the right
answer in its sampling distribution but often not as its most likely one, which is the
situation RL with a verifier exists for (pass@k well above pass@1): the reward finds the
correct behaviour and the held-out greedy accuracy rises within minutes, where learning
arithmetic itself from rewards would take hours on a CPU. The ``tiny`` recipe's shipped
warm start is trained this way (``tools/make_warm_start.py``).

Teachers are chosen by name (:data:`TEACHERS`) or by dotted path ``package.module:factory``;
a factory takes the ``sft.teacher_kwargs`` and returns the teacher.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Optional

from megatron_logra.rewards.base import Problem, stable_hash

__all__ = ["Teacher", "TEACHERS", "build_teacher", "reference", "careless_arithmetic", "evaluate_chain"]

Teacher = Callable[[Problem, int], str]

_CHAIN_RE = re.compile(r"^\s*-?\d+(\s*[+-]\s*-?\d+)*\s*$")
_TERM_RE = re.compile(r"([+-]?)\s*(-?\d+)")


def evaluate_chain(expression: str, *, minus_as_plus: bool = False) -> Optional[int]:
    """Value of an expression of integers joined by ``+``/``-`` (``None`` if it is not one)."""
    if not _CHAIN_RE.match(expression):
        return None
    total = 0
    for op, number in _TERM_RE.findall(expression):
        value = int(number)
        total += value if (op != "-" or minus_as_plus) else -value
    return total


def reference() -> Teacher:
    """The dataset's reference answer."""
    return lambda problem, index: problem.answer


SLIPS = ("echo_equals", "drop_tens", "minus_as_plus")


def careless_arithmetic(slip_rate: float = 0.6, slip: str = "drop_tens", seed: int = 0) -> Teacher:
    """Makes ``slip`` in a ``slip_rate`` share of demonstrations (chosen by a hash of the
    demonstration index and ``seed``): ``echo_equals`` answers ``= <reference>``, ``drop_tens`` answers ``sign·(|v| mod 10)``,
    ``minus_as_plus`` evaluates the expression with every ``-`` read as ``+``. Problems without
    an arithmetic ``metadata['expression']`` get the reference answer."""
    if not 0.0 <= slip_rate <= 1.0:
        raise ValueError(f"sft.teacher_kwargs.slip_rate={slip_rate} must be in [0, 1]")
    if slip not in SLIPS:
        raise ValueError(f"sft.teacher_kwargs.slip={slip!r} is not one of {SLIPS}")

    def teach(problem: Problem, index: int) -> str:
        expression = problem.metadata.get("expression")
        if not isinstance(expression, str):
            return problem.answer
        if stable_hash(seed, "careless", index) / 2.0**64 >= slip_rate:
            return problem.answer
        if slip == "echo_equals":
            return f"= {problem.answer}"
        value = evaluate_chain(expression, minus_as_plus=slip == "minus_as_plus")
        if value is None:
            return problem.answer
        if slip == "drop_tens":
            value = (abs(value) % 10) * (1 if value >= 0 else -1)
        return str(value)

    return teach


TEACHERS: dict[str, Callable[..., Teacher]] = {"reference": reference, "careless_arithmetic": careless_arithmetic}


def build_teacher(name: str, kwargs: Optional[dict[str, Any]] = None) -> Teacher:
    """The teacher named ``name`` (a key of :data:`TEACHERS` or ``package.module:factory``)."""
    kwargs = dict(kwargs or {})
    if name in TEACHERS:
        factory = TEACHERS[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"sft.teacher={name!r} cannot be imported: {exc}") from exc
    else:
        raise ValueError(f"unknown sft.teacher {name!r}: choose one of {sorted(TEACHERS)} or 'package.module:factory'")
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"sft.teacher_kwargs {kwargs} do not fit teacher {name!r}: {exc}") from exc

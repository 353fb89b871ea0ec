"""reasoning-gym tasks as problem sources, scored with each dataset's own ``score_answer``.

Any of reasoning-gym's registered datasets (``reasoning_gym.factory.DATASETS``, 106 in 0.1.25)
can be used by name. Items are produced by ``create_dataset(name, seed=..., size=..., **kwargs)``
and ``dataset[raw_index]``; most datasets draw item ``i`` from ``random.Random(seed + i)``, so two
instances whose seeds differ by ``d`` produce the *same* items shifted by ``d`` — a different seed
is NOT a held-out split. Disjointness is therefore enforced by prompt text (see ``task.py``).

``size`` is a *virtual* size for procedural datasets (any index is valid), but a few datasets
precompute ``size`` items in their constructor or bound the index (acre, list_functions,
gsm_symbolic, word_ladder, ...): those get the smaller defaults in :data:`GYM_DEFAULT_SIZES`, and
any dataset accepts an explicit ``size`` in its kwargs. Raw indices are taken modulo ``size``.

reasoning-gym imports take seconds (it loads all 106 tasks), so it is imported lazily.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import typing
from typing import Any

from megatron_logra.rewards.base import Problem, extract_tagged_answer

__all__ = [
    "GYM_DEFAULT_SIZES",
    "GYM_VIRTUAL_SIZE",
    "GymScorer",
    "GymSource",
    "extract_gym_answer",
    "list_gym_datasets",
    "validate_gym_name",
]

logger = logging.getLogger(__name__)

GYM_VIRTUAL_SIZE = 2**31 - 1
"""Virtual dataset size handed to procedural reasoning-gym datasets (any index is valid)."""

GYM_DEFAULT_SIZES: dict[str, int] = {
    "acre": 1_000,
    "gsm_symbolic": 100_000,
    "list_functions": 100_000,
    "word_ladder": 20_000,
}
"""Sizes for datasets that precompute or bound their items (override with ``dataset_kwargs[name]["size"]``)."""


def list_gym_datasets() -> list[str]:
    """Sorted names of every dataset registered in reasoning-gym."""
    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def validate_gym_name(name: str, field: str = "task.datasets") -> None:
    """Raise ValueError naming ``field`` when ``name`` is not a registered reasoning-gym dataset."""
    names = list_gym_datasets()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    examples = ", ".join(["chain_sum", "basic_arithmetic", "products", "gcd", "spell_backward"])
    raise ValueError(
        f"{field}: {name!r} is not a reasoning-gym dataset.{hint} Valid names include {examples} "
        f"({len(names)} in all; megatron_logra.rewards.gym.list_gym_datasets() lists them), "
        f"or use 'jsonl:PATH' for a local file."
    )


def _config_fields(name: str) -> list[str]:
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[name][1]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]


_SCALAR_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int, float),  # reasoning-gym gives some int-annotated fields float values (rearc's diff_ub=0.2)
    float: (int, float),
    bool: (bool,),
    str: (str,),
}


def _scalar_types(annotation: Any) -> tuple[tuple[type, ...], bool] | None:
    """(accepted Python types, None allowed) of a scalar config annotation; None for any other annotation."""
    if annotation in _SCALAR_TYPES:
        return _SCALAR_TYPES[annotation], False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        if inner in _SCALAR_TYPES:
            return _SCALAR_TYPES[inner], True
    return None


def _check_kwargs(name: str, kwargs: dict[str, Any], field: str) -> None:
    """ValueError naming ``field`` for a key ``name``'s config lacks (with the closest valid key) or a
    value whose JSON type cannot be the field's scalar type (``"2"`` for an int, ``"no"`` for a bool)."""
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[name][1]
    valid = _config_fields(name)
    for key, value in kwargs.items():
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{field}: {key!r} is not a field of {name}'s config ({config_cls.__name__}); {hint}"
                             f"valid keys: {', '.join(valid)}, size")
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: leave the values to reasoning-gym
        return
    for key, value in kwargs.items():
        accepted = _scalar_types(hints.get(key))
        if accepted is None:
            continue
        types, optional = accepted
        if value is None and optional:
            continue
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            kind, example = _KIND[types[0]]
            raise ValueError(f"{field}: {key}={json.dumps(value, default=str)} is a JSON {_JSON_NAME.get(type(value), 'value')}, "
                             f"but {name}'s config expects {kind}{' or null' if optional else ''}, e.g. "
                             f"{{{json.dumps(key)}: {example}}}")


_KIND: dict[type, tuple[str, str]] = {int: ("a number", "2"), float: ("a number", "0.5"),
                                      bool: ("true or false", "true"), str: ("a string", '"text"')}
"""How a scalar field's expected JSON value is named in errors, and an example of it."""

_JSON_NAME: dict[type, str] = {str: "string", int: "number", float: "number", bool: "boolean", list: "array",
                               dict: "object"}


def create_gym_dataset(name: str, seed: int, kwargs: dict[str, Any] | None = None) -> Any:
    """``reasoning_gym.create_dataset`` with our seed and size (with user kwargs, its first item generated).

    Raises ValueError naming ``task.dataset_kwargs[name]`` for ``seed`` (seeded from ``task.seed``), a
    ``size`` that is not a positive integer, an unknown key (with the closest valid one), a scalar of the
    wrong JSON type, values the dataset's validation refuses and values with which it cannot generate its
    first item (found here, at start, not mid-training); and for ``composite``, whose mixture is
    ``task.datasets`` + ``task.weights`` here.
    """
    if name == "composite":
        raise ValueError(
            "task.datasets: 'composite' (reasoning-gym's dataset mixture) is not supported; list the datasets "
            "themselves with their weights instead, e.g. task.datasets=chain_sum,gcd task.weights=2,1 (and "
            "task.dataset_kwargs for their configs)"
        )
    validate_gym_name(name)
    import reasoning_gym

    kwargs = dict(kwargs or {})
    field = f"task.dataset_kwargs[{name!r}]"
    if "seed" in kwargs:
        raise ValueError(f"{field}: do not set 'seed' here; datasets are seeded from task.seed")
    size = kwargs.pop("size", GYM_DEFAULT_SIZES.get(name, GYM_VIRTUAL_SIZE))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{field}: size={size!r} must be a positive integer")
    _check_kwargs(name, kwargs, field)
    try:
        dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **kwargs)
    except (AssertionError, TypeError, ValueError) as exc:  # keys are known: a value the config refuses
        raise ValueError(f"{field}={kwargs!r} failed {name}'s validation: {exc or type(exc).__name__}") from exc
    if kwargs:  # the defaults are known to work; values of the user's may fail only when items are made
        try:
            dataset[0]
        except Exception as exc:  # noqa: BLE001 - any failure here is the configuration's
            raise ValueError(f"{field}={kwargs!r}: {name} cannot generate an item with this config "
                             f"({type(exc).__name__}: {exc}); check the values against {name}'s config") from exc
    return dataset


def extract_gym_answer(completion: str) -> str:
    """Answer handed to ``score_answer``: the last ``<answer>...</answer>`` content, else the stripped completion."""
    tagged = extract_tagged_answer(completion)
    return tagged if tagged is not None else completion.strip()


class GymSource:
    """Problems of one reasoning-gym dataset; ``problem(i)`` is ``dataset[i % size]``.

    ``Problem.metadata`` is the entry's own metadata dict, which the dataset's scorer reads back.
    Datasets without a single oracle answer (graph_color, boxnet, propositional_logic, ...) give
    ``answer=None``; it becomes ``Problem.answer == ""`` with ``has_answer=False`` and is passed back
    to the scorer as None. A real oracle of ``""`` (``ab`` items that reduce to the empty program)
    keeps ``has_answer=True`` and is passed back as ``""``.
    """

    def __init__(self, name: str, seed: int, kwargs: dict[str, Any] | None = None) -> None:
        self.name = name
        self.seed = seed
        self.dataset = create_gym_dataset(name, seed, kwargs)
        self.size: int | None = int(self.dataset.size)

    def problem(self, raw_index: int) -> Problem:
        """The dataset's item at ``raw_index % size`` as a Problem."""
        assert self.size is not None
        entry = self.dataset[raw_index % self.size]
        return Problem(
            prompt=str(entry["question"]),
            answer="" if entry["answer"] is None else str(entry["answer"]),
            source=self.name,
            metadata=dict(entry.get("metadata") or {}),
            has_answer=entry["answer"] is not None,
        )


class GymScorer:
    """Scores with the dataset's own ``score_answer(answer=..., entry=...)``, clamped to ``[0, 1]``.

    The answer is extracted by :func:`extract_gym_answer`. A scorer that raises on a malformed
    answer (reasoning-gym scorers parse free text) scores 0.0 and is logged at debug level:
    arbitrary model output must never abort a training step.
    """

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset = dataset
        self.name = name

    def score(self, problem: Problem, completion: str) -> float:
        """Score in ``[0, 1]``; 1.0 for the oracle answer (the entry's answer is None iff ``not problem.has_answer``)."""
        oracle = problem.answer if problem.has_answer else None
        entry = {"question": problem.prompt, "answer": oracle, "metadata": problem.metadata}
        answer = extract_gym_answer(completion)
        try:
            value = float(self.dataset.score_answer(answer=answer, entry=entry))
        except Exception as exc:  # noqa: BLE001 - free-form model output must not crash training
            logger.debug("%s.score_answer raised %s on %r; scored 0", self.name, type(exc).__name__, answer[:80])
            return 0.0
        if not math.isfinite(value):
            return 0.0
        return min(1.0, max(0.0, value))

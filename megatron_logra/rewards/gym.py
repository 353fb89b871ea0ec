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
import logging
import math
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


def create_gym_dataset(name: str, seed: int, kwargs: dict[str, Any] | None = None) -> Any:
    """``reasoning_gym.create_dataset`` with our seed and size; bad kwargs raise ValueError naming them."""
    validate_gym_name(name)
    import reasoning_gym

    kwargs = dict(kwargs or {})
    field = f"task.dataset_kwargs[{name!r}]"
    if "seed" in kwargs:
        raise ValueError(f"{field}: do not set 'seed' here; datasets are seeded from task.seed")
    size = kwargs.pop("size", GYM_DEFAULT_SIZES.get(name, GYM_VIRTUAL_SIZE))
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{field}: size={size!r} must be a positive integer")
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **kwargs)
    except TypeError as exc:
        raise ValueError(
            f"{field}={kwargs!r} is not accepted by {name}'s config ({exc}); valid keys: "
            f"{', '.join(_config_fields(name))}, size"
        ) from exc
    except (AssertionError, ValueError) as exc:
        raise ValueError(f"{field}={kwargs!r} failed {name}'s validation: {exc or type(exc).__name__}") from exc


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

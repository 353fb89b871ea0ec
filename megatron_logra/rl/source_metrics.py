"""Per-source metrics of a task mixture (``task.datasets=chain_sum,gcd``): each step record's reward and accuracy
per source of its rollouts (``reward_mean/chain_sum``, ``accuracy/gcd``), and held-out accuracy per source
(``eval_accuracy/gcd``), as verl logs per data source. A task of one source records none (its overall values say
it all).

Contract: :func:`source_sums` is this rank's ``[num_sources, 3]`` float64 sums (reward, correct, samples) in the
task's source order; the caller all-reduces them over DP and :func:`source_fields` names them. A source without a
sample in the step (a small weight) is ``null``. A source's field name is its name with a ``jsonl:`` (or
``parquet:``) file reduced to the file's name (``jsonl:/data/math500.jsonl`` → ``jsonl:math500.jsonl``; the whole path, ``/`` as ``_``,
when two files share a name), so that dashboards that group fields by ``/`` keep one group per metric.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megatron_logra.rewards.jsonl import file_spec_path

__all__ = ["field_names", "source_fields", "source_sums"]


def field_names(names: Sequence[str]) -> list[str]:
    """The field-name form of each source name (see the module doc)."""
    short = []
    for name in names:
        path = file_spec_path(name)
        short.append(name[: len(name) - len(path)] + path.rsplit("/", 1)[-1] if path else name)
    if len(set(short)) != len(short):
        return [name.replace("/", "_") for name in names]
    return short


def source_sums(names: Sequence[str], problems: Sequence[Any], scored: Sequence[tuple[float, bool]]
                ) -> torch.Tensor:
    """``[len(names), 3]`` float64: per source, the sum of rewards, the correct samples and the samples, of
    ``scored[i]`` for ``problems[i]`` (matched by ``problem.source``)."""
    index = {name: k for k, name in enumerate(names)}
    sums = torch.zeros(len(names), 3, dtype=torch.float64)
    for problem, (reward, correct) in zip(problems, scored):
        k = index[problem.source]
        sums[k, 0] += reward
        sums[k, 1] += float(correct)
        sums[k, 2] += 1.0
    return sums


def source_fields(names: Sequence[str], sums: torch.Tensor, **prefixes: Optional[str]) -> dict[str, Optional[float]]:
    """Named per-source fields of all-reduced :func:`source_sums` for a mixture (``{}`` for one source):
    ``reward=PREFIX`` names the mean rewards, ``accuracy=PREFIX`` the accuracies, ``None`` (or absent) leaves
    that metric out; e.g. ``source_fields(names, sums, reward="reward_mean", accuracy="accuracy")``."""
    if len(names) < 2:
        return {}
    out: dict[str, Optional[float]] = {}
    for column, key in ((0, "reward"), (1, "accuracy")):
        prefix = prefixes.get(key)
        if prefix is None:
            continue
        for name, row in zip(field_names(names), sums.tolist()):
            out[f"{prefix}/{name}"] = row[column] / row[2] if row[2] > 0 else None
    return out

"""The RL task's config (:class:`TaskConfig`): which problems to train on, how to hold out eval problems and how to
reward answers, checked when it is built (a ``ValueError`` naming the field and the fix)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

from megatron_logra.rewards.jsonl import file_spec_path
from megatron_logra.rewards.reward_checks import check_reward_fields
from megatron_logra.rewards.source_specs import file_key, source_specs

__all__ = ["TaskConfig"]


@dataclass
class TaskConfig:
    """RL task: which problems to train on, how to hold out eval problems and how to reward answers."""

    datasets: list[str] = field(default_factory=lambda: ["chain_sum"])
    """Problem sources: reasoning-gym dataset names (e.g. chain_sum, gcd, spell_backward) or
    ``jsonl:PATH`` for a local JSONL file (``prompt``/``answer`` or MATH-500 keys), ``parquet:PATH`` for a Parquet
    file of such rows (verl's prepared datasets; needs pyarrow). A comma-separated
    string is accepted too; a ``jsonl:`` path may hold commas (``jsonl:/data/a,b.jsonl``: a piece after it that is
    no dataset name of its own, or that makes it an existing file, belongs to the path:
    :func:`~megatron_logra.rewards.jsonl.join_jsonl_paths`)."""
    weights: list[float] = field(default_factory=list)
    """Mixture weights, one per dataset (>= 0, positive sum); empty = uniform."""
    eval_datasets: list[str] = field(default_factory=list)
    """Held-out benchmarks of their own, as slime's ``--eval-prompt-data`` and verl's ``data.val_files``:
    reasoning-gym names or ``jsonl:PATH`` (e.g. ``jsonl:/data/math500.jsonl``), written as ``datasets`` is. Empty:
    the held-out set is split from ``datasets`` by ``eval_modulus``. Given: the held-out set is up to ``num_eval``
    problems of each (a file's rows in file order, a reasoning-gym dataset's drawn with ``eval_seed``), evaluated
    with its own per-source accuracy, and training uses every prompt of ``datasets`` except those (by text), so
    the two stay disjoint. A file may not be in both lists."""
    dataset_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per reasoning-gym dataset config kwargs, e.g. ``{"chain_sum": {"min_terms": 2, "max_terms": 2,
    "min_digits": 1, "max_digits": 1}}``; ``size`` sets the dataset's (virtual) size. A JSON string is
    accepted too. Every key must be a reasoning-gym dataset of ``datasets``; an override (or recipe file) that
    sets ``datasets`` alone drops the kwargs of datasets it no longer lists (a recipe's kwargs belong to its
    datasets)."""
    jsonl_prompt_key: str = ""
    """The key of a ``jsonl:`` file's rows that holds the prompt (slime's ``--input-key``; a dotted key reaches into
    an object); empty: the first present of ``prompt``, ``problem``, ``question``. A string, or one user message
    ``[{"role": "user", "content": ...}]``."""
    jsonl_answer_key: str = ""
    """The key of a ``jsonl:`` file's rows that holds the gold answer (slime's ``--label-key``; dotted for nested
    objects, e.g. ``reward_model.ground_truth``); empty: the first present of ``answer``, ``label``,
    ``reward_model.ground_truth``, else the last ``\\boxed{...}`` of ``solution``."""
    reward: str = "auto"
    """auto (each gym dataset's own scorer, math-verify for JSONL), math_verify (for every source), a dotted
    path ``package.module:function`` of ``fn(problem, completion) -> score in [0, 1]``, the URL of a reward
    server, ``http://HOST:PORT/PATH`` (slime's ``--rm-url``; :mod:`megatron_logra.rewards.remote`), or a slime
    reward function as it is, ``slime:package.module:function`` (or slime's ``--custom-rm-path`` spelling
    ``slime:package.module.function``): ``[async] def rm(args, sample) -> float``, whose float is the reward
    itself (:mod:`megatron_logra.rewards.slime_rm`)."""
    correct_reward: float = 1.0
    """Reward of a correct answer (score >= 1). With a slime reward function (``task.reward=slime:...``), whose
    float is the reward itself, the threshold of a correct answer instead: a reward >= ``correct_reward`` counts as
    correct (the accuracy); ``wrong_reward`` and ``graded`` are then unused."""
    wrong_reward: float = -0.01
    """Reward of a wrong answer (score 0); graded scores interpolate linearly up to correct_reward."""
    graded: bool = True
    """Graded scores in (0, 1) interpolate between wrong_reward and correct_reward; False makes every
    score < 1 earn wrong_reward (binary rewards: reasoning-gym grants partial credit, e.g. chain_sum
    scores an answer that merely contains the oracle by the length ratio)."""
    num_eval: int = 200
    """Held-out eval problems (split over datasets by weight; with ``eval_datasets``, per benchmark); 0 disables
    the eval set (the eval-only prompts of ``eval_modulus`` are still never trained on, so that the split is the
    same for every ``num_eval``; with ``eval_datasets`` nothing is held out, so training may use their prompts, and
    a warning says so)."""
    max_prompt_tokens: int = 0
    """The most tokens a training prompt may have (slime's ``--rollout-max-prompt-len``), counted as the policy
    reads it (``rl.prompt_template`` and ``rl.chat_template`` applied): the train stream skips longer prompts, as it
    skips those that do not fit ``model.seq_length`` (counted in each step's ``prompts_skipped``, one warning per
    source; a ``jsonl:`` file's longer rows are skipped, not refused). The held-out set is not limited by it (slime's
    evaluation prompts have a cap of their own: ``eval_max_prompt_tokens``): its prompts need only fit the model.
    0 = no limit."""
    eval_max_prompt_tokens: int = 0
    """The most tokens a held-out prompt may have (slime's ``--eval-max-prompt-len``), counted as
    ``max_prompt_tokens`` counts a training prompt: the held-out set drops longer prompts (one warning per source,
    counted under ``"NAME (held-out)"`` in ``overlong_skips``) and takes the next ones in its fixed order, the same
    on every rank (a pure function of the prompt text); a benchmark (``eval_datasets``) none of whose held-out
    prompts is within it is refused at start. Training prompts are not limited by it. 0 = no limit."""
    seed: int = 1234
    """Seed of the train stream (and of the datasets that produce it)."""
    eval_seed: int = 4321
    """Seed of the eval set; fixed by default so runs with different ``seed`` share one eval set."""
    eval_modulus: int = 16
    """Prompts whose text hash % eval_modulus == 0 are eval-only (about 1/eval_modulus of every
    prompt space); the train stream skips them, guaranteeing train/eval disjointness."""
    math_timeout_s: int = 5
    """Seconds math-verify may spend per parse / verify on the main thread (0 = no timeout;
    off the main thread there is never a timeout, since math-verify uses signal.alarm)."""
    reward_timeout_s: float = 60.0
    """Seconds one call of a ``task.reward`` plugin may take for one completion (0 = no limit). Past it the
    run stops with an error naming the RL step, the sample and this field, instead of hanging (a code sandbox,
    a reward server, an endless loop); the checkpoint before the step is intact. On the main thread (the RL
    loop's) the plugin runs there under a watchdog signal, so math-verify's own ``signal.alarm`` timeouts keep
    working; called off the main thread it runs on a daemon worker thread (no ``signal.alarm`` there: call
    math-verify with ``parsing_timeout=None`` / ``timeout_seconds=None``, or set 0). Built-in scorers are not
    affected (math-verify has ``math_timeout_s``), except with ``reward_workers``, where it bounds every call."""
    reward_workers: int = 0
    """Worker processes that score rewards (0: the trainer's own process). N >= 1: each process that scores
    (every data-parallel rank scores its own completions) starts N ``spawn`` workers at its first scoring; they
    rebuild the task's scorers and score N completions at a time, bit-identically. A call past
    ``reward_timeout_s`` has its worker killed and replaced (the run stops as for any timed-out reward), also in C
    code that holds the GIL (a backtracking regex), which no limit stops in-process; a reward function that
    crashes its worker (``os._exit``, a segfault) stops the run naming it. Costs seconds and memory per worker
    (:mod:`megatron_logra.rewards.process_pool`)."""
    reward_group: bool = False
    """Call the slime reward function (``task.reward=slime:...``) once per prompt with the list of that prompt's
    samples, as slime's ``--group-rm``: ``[async] def rm(args, samples) -> list[float]``, one reward per sample in
    their order (a training step's ``rl.group_size``; at a held-out evaluation a problem's
    ``rl.rollout.eval_samples``, which slime, refusing ``--group-rm`` there, never calls). ``task.reward_timeout_s``
    then bounds one call, a whole group, in process and in ``reward_workers`` alike
    (:mod:`megatron_logra.rewards.slime_group`)."""

    def __post_init__(self) -> None:
        self.datasets = source_specs(self.datasets, "datasets")
        if not self.datasets:
            raise ValueError("task.datasets is empty: name at least one dataset, e.g. ['chain_sum']")
        dupes = sorted({d for d in self.datasets if self.datasets.count(d) > 1})
        if dupes:
            raise ValueError(f"task.datasets lists {dupes} more than once; list each once and use task.weights")
        self.eval_datasets = source_specs(self.eval_datasets, "eval_datasets")
        dupes = sorted({d for d in self.eval_datasets if self.eval_datasets.count(d) > 1})
        if dupes:
            raise ValueError(f"task.eval_datasets lists {dupes} more than once; list each once")
        trained = {file_key(spec) for spec in self.datasets if file_spec_path(spec) is not None}
        both = [spec for spec in self.eval_datasets if file_spec_path(spec) is not None and file_key(spec) in trained]
        if both:
            raise ValueError(
                f"task.eval_datasets: {both[0]!r} is also in task.datasets; a benchmark of its own must be another "
                f"file (leave task.eval_datasets empty to hold out 1/task.eval_modulus of the training file)")
        for name in ("jsonl_prompt_key", "jsonl_answer_key"):
            value = getattr(self, name)
            if not isinstance(value, str) or value != value.strip() or ".." in value or value.startswith(".") \
                    or value.endswith("."):
                raise ValueError(f"task.{name}={value!r}: give a key of the rows (e.g. task.{name}="
                                 f"{'prompt' if 'prompt' in name else 'label'}), dotted for a nested object, or leave "
                                 f"it empty for the usual keys")
        self._check_weights()
        self._check_kwargs()
        if isinstance(self.max_prompt_tokens, bool) or not isinstance(self.max_prompt_tokens, int) \
                or self.max_prompt_tokens < 0:
            raise ValueError(f"task.max_prompt_tokens={self.max_prompt_tokens!r} must be a whole number >= 0 (the "
                             f"most tokens of a training prompt; 0 = no limit)")
        if isinstance(self.eval_max_prompt_tokens, bool) or not isinstance(self.eval_max_prompt_tokens, int) \
                or self.eval_max_prompt_tokens < 0:
            raise ValueError(f"task.eval_max_prompt_tokens={self.eval_max_prompt_tokens!r} must be a whole number >= 0 "
                             f"(the most tokens of a held-out prompt, --eval-max-prompt-len; 0 = no limit)")
        if self.num_eval < 0:
            raise ValueError(f"task.num_eval={self.num_eval} must be >= 0")
        if self.eval_modulus < 2:
            raise ValueError(f"task.eval_modulus={self.eval_modulus} must be >= 2 (1/eval_modulus is held out)")
        if self.math_timeout_s < 0:
            raise ValueError(f"task.math_timeout_s={self.math_timeout_s} must be >= 0 (0 = no timeout)")
        check_reward_fields(self)

    def _check_weights(self) -> None:
        if isinstance(self.weights, str):
            self.weights = [s for s in self.weights.split(",") if s.strip()]
        try:
            self.weights = [float(w) for w in self.weights]
        except (TypeError, ValueError):
            raise ValueError(f"task.weights={self.weights!r}: every weight must be a number") from None
        if not self.weights:
            return
        if len(self.weights) != len(self.datasets):
            raise ValueError(
                f"task.weights has {len(self.weights)} entries for {len(self.datasets)} datasets: "
                f"give one weight per dataset or none (uniform)"
            )
        if any(not isfinite(w) or w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError(f"task.weights={self.weights}: weights must be finite, >= 0, with a positive sum")

    def _check_kwargs(self) -> None:
        if isinstance(self.dataset_kwargs, str):
            try:
                self.dataset_kwargs = json.loads(self.dataset_kwargs) if self.dataset_kwargs.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"task.dataset_kwargs: not valid JSON ({exc.msg})") from None
        if not isinstance(self.dataset_kwargs, dict):
            raise ValueError(f"task.dataset_kwargs must map dataset names to dicts, got {self.dataset_kwargs!r}")
        for name, kwargs in self.dataset_kwargs.items():
            if name not in self.datasets + self.eval_datasets or file_spec_path(name) is not None:
                raise ValueError(
                    f"task.dataset_kwargs[{name!r}]: not a reasoning-gym dataset of task.datasets {self.datasets}"
                    f"{f' or task.eval_datasets {self.eval_datasets}' if self.eval_datasets else ''}; "
                    f"drop {name!r} from task.dataset_kwargs (task.dataset_kwargs={{}} clears them all) or list it "
                    f"in task.datasets"
                )
            if not isinstance(kwargs, dict):
                raise ValueError(f"task.dataset_kwargs[{name!r}]={kwargs!r} must be a dict of config kwargs")

    @property
    def normalized_weights(self) -> list[float]:
        """Weights summing to 1 (uniform when ``weights`` is empty)."""
        weights = self.weights or [1.0] * len(self.datasets)
        total = sum(weights)
        return [w / total for w in weights]


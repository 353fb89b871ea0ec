"""Building a :class:`~megatron_logra.rewards.task.Task` from its :class:`~megatron_logra.rewards.config.TaskConfig`:
the train sources, the held-out sources (split by ``task.eval_modulus``, or the benchmarks of ``task.eval_datasets``)
and a scorer per source."""

from __future__ import annotations

from typing import Any, Callable

from megatron_logra.rewards.base import ProblemSource, Scorer, prompt_bucket, stable_hash
from megatron_logra.rewards.config import TaskConfig
from megatron_logra.rewards.jsonl import JsonlSource, file_spec_path
from megatron_logra.rewards.math import MathVerifyScorer, parses_as_math
from megatron_logra.rewards.plugins import PluginScorer, is_dotted_path, is_slime_path
from megatron_logra.rewards.process_pool import RewardProcessPool
from megatron_logra.rewards.remote import RemoteScorer, is_reward_url
from megatron_logra.rewards.slime_group import SlimeGroupScorer
from megatron_logra.rewards.slime_rm import SlimeScorer, slime_args
from megatron_logra.rewards.task import Task

__all__ = ["build_scorers", "build_task"]

MATH_PROBES = 8
"""Problems of a reasoning-gym dataset checked for a reference answer math-verify parses (``task.reward=math_verify``)."""


def _seed_for(seed: int, name: str, split: str) -> int:
    return stable_hash(seed, split, name) % (2**31 - 1)


def _check_trainable(source: JsonlSource, cfg: TaskConfig) -> None:
    """ValueError naming the file when every prompt of ``source`` is eval-only (the train stream would have none)."""
    rows = len(source.problems)
    if any(prompt_bucket(p.prompt, cfg.eval_modulus) != 0 for p in source.problems):
        return
    raise ValueError(
        f"{source.path}: all {rows} prompt(s) of task.datasets entry {source.name!r} are eval-only (prompt hash % "
        f"task.eval_modulus={cfg.eval_modulus} == 0, about 1 in {cfg.eval_modulus} prompts, whatever task.num_eval), "
        f"which leaves no training rows; add rows to the file or choose another task.eval_modulus"
    )


def _check_math_answers(source: ProblemSource, parses: Callable[[str], bool]) -> None:
    """ValueError naming the reasoning-gym dataset when none of its first :data:`MATH_PROBES` problems has a reference
    answer math-verify can parse (``task.reward=math_verify``): no completion could ever be rewarded, as for a JSONL
    file of only such rows (graph_color, propositional_logic: no single oracle answer)."""
    probes = [source.problem(i) for i in range(MATH_PROBES)]
    if any(p.has_answer and parses(p.answer) for p in probes):
        return
    answers = [p.answer for p in probes if p.has_answer]
    what = (f"e.g. {answers[0][:80]!r}, which math-verify cannot parse" if answers else
            "it gives no single oracle answer")
    raise ValueError(
        f"task.reward=math_verify: reasoning-gym dataset {source.name!r} has no reference answer math-verify can parse "
        f"in its first {MATH_PROBES} problems ({what}), so no completion could ever be rewarded; score it with its own "
        f"score_answer (task.reward=auto) or a task.reward plugin")


def _plugin_scorer(cfg: TaskConfig, plugin_timeout_s: float | None) -> Scorer | None:
    """The user's scorer of every source (``task.reward``: a function by dotted path, a slime reward function, or a
    reward server), or None for the built-in ones. ``plugin_timeout_s`` bounds a function's calls in this process
    (None: no limit)."""
    if is_slime_path(cfg.reward):  # its args: what the config (and the RL job, slime_rm.with_run_args) tells
        scorer = SlimeGroupScorer if cfg.reward_group else SlimeScorer  # --group-rm: a prompt's samples at once
        return scorer(cfg.reward, timeout_s=plugin_timeout_s, args=slime_args(cfg))
    if is_dotted_path(cfg.reward):
        return PluginScorer(cfg.reward, timeout_s=plugin_timeout_s)
    if is_reward_url(cfg.reward):
        return RemoteScorer(cfg.reward, timeout_s=cfg.reward_timeout_s)
    return None


def _source_scorer(cfg: TaskConfig, spec: str, plugin: Scorer | None, math_scorer: Scorer,
                   dataset: Callable[[], Any]) -> Scorer:
    """The scorer of source ``spec``: the plugin, else math-verify for a file (or ``task.reward=math_verify``), else
    the reasoning-gym dataset's own (``dataset()``: the dataset the scorer asks)."""
    if plugin is not None:
        return plugin
    if file_spec_path(spec) is not None or cfg.reward == "math_verify":
        return math_scorer
    from megatron_logra.rewards.gym import GymScorer

    return GymScorer(dataset(), spec)


def build_scorers(cfg: TaskConfig) -> dict[str, Scorer]:
    """The scorer of every source of ``cfg`` (``task.datasets`` and ``task.eval_datasets``), made from the config
    alone exactly as :func:`build_task` makes them (the same plugin loader, a reasoning-gym dataset of the same
    seed and kwargs), without loading any file: what a reward worker process (``task.reward_workers``) scores with.
    A plugin function is called without a limit of its own: the worker's caller bounds the call
    (:mod:`megatron_logra.rewards.process_pool`)."""
    from megatron_logra.rewards.gym import create_gym_dataset

    plugin = _plugin_scorer(cfg, None)
    math_scorer = MathVerifyScorer(timeout_s=cfg.math_timeout_s or None)
    scorers: dict[str, Scorer] = {}
    for spec in dict.fromkeys(cfg.datasets + cfg.eval_datasets):
        # build_task's scorer asks the first dataset it builds for the spec: the train one, else the eval one
        seed, split = (cfg.seed, "train") if spec in cfg.datasets else (cfg.eval_seed, "eval")
        scorers[spec] = _source_scorer(cfg, spec, plugin, math_scorer, lambda: create_gym_dataset(
            spec, _seed_for(seed, spec, split), cfg.dataset_kwargs.get(spec, {})))
    return scorers


def build_task(cfg: TaskConfig, group: Any = None) -> Task:
    """Build the sources, eval sources and scorers of ``cfg``.

    Raises ValueError for unknown reasoning-gym names (listing valid ones), bad dataset kwargs, an
    unloadable reward plugin, a source of positive weight with no training prompt (every prompt it
    yields is eval-only: a JSONL file of such rows, a reasoning-gym dataset made tiny by ``size``), and
    FileNotFoundError / ValueError for missing or malformed JSONL files. The rows of a JSONL file scored with
    math-verify whose gold answer it cannot parse are dropped with one warning (a file of no other rows is a
    ValueError): :meth:`~megatron_logra.rewards.jsonl.JsonlSource.drop_unparsable_answers`.

    ``group``: the ranks that build this task together (a process group, ``dist.group.WORLD``, or None: this
    rank alone; every rank of it must call): its rank 0 decides which JSONL rows math-verify can parse and the
    others keep the same rows, so that a parse near math-verify's time limit cannot leave the ranks with
    different datasets.
    """
    cfg.__post_init__()
    timeout = cfg.math_timeout_s or None
    math_scorer = MathVerifyScorer(timeout_s=timeout)
    plugin = _plugin_scorer(cfg, cfg.reward_timeout_s)  # the user's scorer of every source: a function or a server
    sources: list[ProblemSource] = []
    eval_sources: list[ProblemSource] = []
    benchmarks: list[ProblemSource] = []
    scorers: dict[str, Scorer] = {}

    def file_source(spec: str) -> JsonlSource:
        source = JsonlSource(file_spec_path(spec), source=spec, prompt_key=cfg.jsonl_prompt_key,
                             answer_key=cfg.jsonl_answer_key)
        if plugin is None:  # scored with math-verify: a gold answer it cannot parse never earns a reward
            source.drop_unparsable_answers(lambda answer: parses_as_math(answer, timeout_s=timeout), group)
        return source

    def gym_source(spec: str, seed: int, split: str) -> ProblemSource:
        from megatron_logra.rewards.gym import GymSource

        source = GymSource(spec, _seed_for(seed, spec, split), cfg.dataset_kwargs.get(spec, {}))
        if spec not in scorers and plugin is None and cfg.reward == "math_verify":
            _check_math_answers(source, lambda answer: parses_as_math(answer, timeout_s=timeout))
        if spec not in scorers:
            scorers[spec] = _source_scorer(cfg, spec, plugin, math_scorer, lambda: source.dataset)
        return source

    for spec in cfg.datasets:
        if file_spec_path(spec) is not None:
            source = file_source(spec)
            if not cfg.eval_datasets:
                _check_trainable(source, cfg)
            sources.append(source)
            eval_sources.append(source)
            scorers[spec] = _source_scorer(cfg, spec, plugin, math_scorer, lambda: None)
        else:
            sources.append(gym_source(spec, cfg.seed, "train"))
            eval_sources.append(gym_source(spec, cfg.eval_seed, "eval"))
    for spec in cfg.eval_datasets:
        if file_spec_path(spec) is not None:
            benchmarks.append(file_source(spec))
            scorers[spec] = _source_scorer(cfg, spec, plugin, math_scorer, lambda: None)
        else:
            from megatron_logra.rewards.gym import validate_gym_name

            validate_gym_name(spec, "task.eval_datasets")
            benchmarks.append(gym_source(spec, cfg.eval_seed, "eval"))
    task = Task(
        sources,
        scorers,
        cfg.weights or None,
        eval_sources=eval_sources,
        benchmarks=benchmarks,
        seed=cfg.seed,
        eval_seed=cfg.eval_seed,
        num_eval=cfg.num_eval,
        eval_modulus=cfg.eval_modulus,
        correct_reward=cfg.correct_reward,
        wrong_reward=cfg.wrong_reward,
        graded=cfg.graded,
        pool=RewardProcessPool(cfg) if cfg.reward_workers else None,
    )
    task.check_trainable()
    return task

"""Resolving slime's flags that depend on their value or on the rest of the config
(:mod:`~megatron_logra.megatron_flags.slime` holds the tables): each function returns what the flag sets or raises
a ``ValueError`` naming the flag and what to give instead."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from megatron_logra.megatron_flags.slime import CLIP_FLAGS

logger = logging.getLogger(__name__)

__all__ = ["slime_value", "resolve_clip", "check_estimator", "slime_eval_sampling", "check_use_wandb",
           "check_dynamic_batch", "sglang_flag_error"]

_RM_TYPES = {"math": "math_verify", "deepscaler": "math_verify", "dapo": "math_verify"}
"""slime's math graders -> ``task.reward`` scoring the same answers with math-verify."""

_ATTENTION = {"flash": "transformer_engine", "fused": "transformer_engine", "unfused": "local", "local": "local",
              "auto": "auto"}
"""Megatron-LM's ``--attention-backend`` -> ``model.transformer_impl`` (flash / fused attention is
TransformerEngine's; megatron-core's local spec computes unfused attention)."""


def slime_value(flag: str, raw: Any) -> tuple[str, str]:
    """``(field, value)`` that ``--flag raw`` of :data:`SLIME_VALUE_MAPS` sets; a ``ValueError`` naming what to give
    where this trainer has nothing of that meaning."""
    value = str(raw).strip()
    if flag == "advantage-estimator":
        if value == "grpo":
            return "rl.advantage.estimator", "grpo"
        if value == "gspo":  # GRPO's advantages (the default estimator) with the sequence-level ratio's loss
            return "rl.loss.kind", "gspo"
        if value == "reinforce_plus_plus_baseline":  # the group mean only; the whitening: check_estimator
            return "rl.advantage.scale_by_std", "false"
        raise ValueError(f"--advantage-estimator {value}: this trainer's estimators are grpo (--advantage-estimator "
                         f"grpo), gspo (GRPO's advantages, the loss rl.loss.kind=gspo), reinforce_plus_plus_baseline "
                         f"(the group's mean subtracted, the advantages whitened: with --normalize-advantages) and an "
                         f"EMA-baseline REINFORCE (rl.advantage.estimator=reinforce); slime's ppo (a value critic) and "
                         f"reinforce_plus_plus (discounted returns) are not supported")
    if flag == "rm-type":
        if value in _RM_TYPES:
            logger.warning("--rm-type %s: answers are scored by math-verify (task.reward=math_verify), which parses "
                           "the final answer (\\boxed{...} included) and compares it symbolically; slime's %s grader "
                           "may score edge cases differently", value, value)
            return "task.reward", _RM_TYPES[value]
        if value == "remote_rm":
            raise ValueError("--rm-type remote_rm: give the reward server's URL, --rm-url http://HOST:PORT/PATH "
                             "(task.reward)")
        raise ValueError(f"--rm-type {value}: this trainer scores math answers (--rm-type math, deepscaler or dapo: "
                         f"task.reward=math_verify), each reasoning-gym dataset by its own scorer (task.reward=auto), "
                         f"a Python function (task.reward=package.module:function) or a reward server (--rm-url)")
    if flag == "custom-rm-path":
        if not value:
            raise ValueError("--custom-rm-path needs the reward function's path, e.g. --custom-rm-path my_pkg.rm.score")
        return "task.reward", f"slime:{value}"
    if flag == "attention-backend":
        if value in _ATTENTION:
            return "model.transformer_impl", _ATTENTION[value]
        raise ValueError(f"--attention-backend {value}: choose flash or fused (TransformerEngine's attention, "
                         f"model.transformer_impl=transformer_engine), unfused / local (megatron-core's, "
                         f"model.transformer_impl=local) or auto")
    if flag == "log-probs-chunk-size":
        try:
            tokens = int(value)
        except ValueError:
            tokens = None
        if tokens is None or tokens < -1:
            raise ValueError(f"--log-probs-chunk-size {value}: give the tokens per chunk, a whole number > 0, or -1 "
                             f"(slime's default: no chunks, rl.loss.logprob_chunk_tokens=0)")
        return "rl.loss.logprob_chunk_tokens", str(max(tokens, 0))
    raise ValueError(f"--{flag} is not a flag of SLIME_VALUE_MAPS")


def resolve_clip(cfg: Any, flag: str, set_by: dict[str, tuple[str, Any]]) -> Optional[str]:
    """The ``rl.loss.kind`` that ``--eps-clip`` / ``--eps-clip-high`` / ``--eps-clip-c`` imply, against the config the
    other overrides leave (``set_by``: dotted field -> (spelling, value) of the fields the command line set): ``ppo``
    when the line does not choose the loss; None (keep it) where it chose ``ppo`` or ``gspo``
    (``--advantage-estimator gspo``), which read the clip range; None (keep it) where ``--use-tis`` chose ``tis``, logged, since the clip never acts
    at the one optimizer step of a rollout; a ``ValueError`` where the line gives ``rl.loss.kind=tis`` itself."""
    if cfg.job != "rl":
        raise ValueError(f"--{flag} sets the RL job's PPO clip range, which job={cfg.job} does not have; drop --{flag}")
    chosen = set_by.get("rl.loss.kind")
    if chosen is None:
        return "ppo"
    spelling, kind = chosen
    if kind in ("ppo", "gspo"):
        return None
    if spelling.split("=")[0] == "--use-tis":
        logger.warning("--%s is accepted with --use-tis and stored in %s, which the loss does not read: the loss is "
                       "rl.loss.kind=tis, the policy gradient weighted by the rollout's importance weight truncated at "
                       "rl.loss.tis_cap (--tis-clip), as slime's PPO loss with --use-tis is when each rollout makes "
                       "one optimizer step (its ratio is 1 at that step, so its clip never acts)", flag,
                       CLIP_FLAGS[flag])
        return None
    raise ValueError(f"--{flag} sets {CLIP_FLAGS[flag]}, the clip range of rl.loss.kind=ppo, but the loss is given as "
                     f"{spelling}, which does not read it: drop --{flag}, or give rl.loss.kind=ppo (slime's PPO-clip "
                     f"loss)")


def check_estimator(cfg: Any, items: Sequence[tuple[str, Any, str]]) -> None:
    """slime's ``--advantage-estimator reinforce_plus_plus_baseline`` (REINFORCE++ with a group baseline) is the
    group's mean reward subtracted (``rl.advantage.scale_by_std=false``, set by :func:`slime_value`), then the
    advantages whitened over the step's loss tokens, which slime requires ``--normalize-advantages`` for, and the
    rewards normalised per group: refused without ``rl.advantage.normalize`` or with ``rl.advantage.baseline=none``
    (``--disable-rewards-normalization``), as slime refuses them. ``items``: the line's (flag, value, spelling)."""
    given = [raw for key, raw, _ in items if key == "advantage-estimator"]
    if not given or str(given[-1]).strip().lower() != "reinforce_plus_plus_baseline":
        return
    if cfg.rl.advantage.baseline == "none":
        raise ValueError("--advantage-estimator reinforce_plus_plus_baseline subtracts each group's mean reward, which "
                         "--disable-rewards-normalization (rl.advantage.baseline=none) turns off: drop one of them")
    if not cfg.rl.advantage.normalize:
        raise ValueError("--advantage-estimator reinforce_plus_plus_baseline whitens the advantages over the step's "
                         "tokens, as slime does only with --normalize-advantages: give --normalize-advantages "
                         "(rl.advantage.normalize=true)")


def slime_eval_sampling(cfg: Any, items: Sequence[tuple[str, Any, str]],
                        set_by: dict[str, tuple[str, Any]]) -> list[tuple[str, Any, str]]:
    """slime samples held-out answers at ``--eval-temperature`` / ``--eval-top-p`` or, where the line gives none, at the
    rollout's temperature and top-p. Held-out evaluation here is greedy by default (``rl.rollout.eval_temperature=0``),
    which cannot give ``--n-samples-per-eval-prompt k > 1`` different answers: for such a line that sets no held-out
    temperature (nor the field), the ``(field, value, spelling)`` items that take the rollout's, as slime does (and its
    top-p where the held-out one is not given either); nothing otherwise. ``set_by``: the fields the line set."""
    given = [(raw, spelling) for key, raw, spelling in items if key == "n-samples-per-eval-prompt"]
    rollout = cfg.rl.rollout
    if not given or rollout.eval_samples <= 1 or rollout.eval_temperature != 0 \
            or "rl.rollout.eval_temperature" in set_by:
        return []
    spelling = given[-1][1]
    out = [("rl.rollout.eval_temperature", rollout.temperature, spelling)]
    if "rl.rollout.eval_top_p" not in set_by:
        out.append(("rl.rollout.eval_top_p", rollout.top_p, spelling))
    logger.info("%s without --eval-temperature: held-out answers are sampled at the rollout's temperature %g (and "
                "top-p %g), as slime samples them", spelling, rollout.temperature,
                rollout.top_p if len(out) > 1 else rollout.eval_top_p)
    return out


def check_use_wandb(cfg: Any) -> None:
    """slime's ``--use-wandb``: W&B logging is on here when ``train.wandb_project`` is set, so the switch is accepted
    with a project and refused alone."""
    if not cfg.train.wandb_project:
        raise ValueError("--use-wandb: W&B logging is on when train.wandb_project is set (no switch turns it on): give "
                         "--wandb-project NAME, or drop --use-wandb")


def check_dynamic_batch(cfg: Any) -> None:
    """slime's ``--use-dynamic-batch-size``: micro-batches by a token budget, which is ``rl.max_tokens_per_micro_batch``
    here (``--max-tokens-per-gpu`` sets it), so the switch is accepted with a budget and refused without one, as
    slime refuses it without ``--max-tokens-per-gpu``."""
    if not cfg.rl.max_tokens_per_micro_batch:
        raise ValueError("--use-dynamic-batch-size needs a token budget: give --max-tokens-per-gpu N "
                         "(rl.max_tokens_per_micro_batch=N, the positions of one micro-batch), or drop "
                         "--use-dynamic-batch-size")


_SLIME_OWN_SGLANG = ("sglang-router-", "sglang-server-concurrency")
"""slime's ``--sglang-*`` flags that configure slime itself (its router, its request concurrency), not SGLang."""


def sglang_flag_error(flag: str) -> Optional[ValueError]:
    """The error for slime's ``--sglang-NAME`` flags that no table maps: slime passes them to SGLang's server
    arguments, which are ``rl.rollout.sglang_engine_args`` here; None for other flags."""
    if not flag.startswith("sglang-"):
        return None
    if flag.startswith(_SLIME_OWN_SGLANG):
        return ValueError(f"--{flag} configures slime's router and request scheduling, which this trainer does not "
                          f"have: the in-process SGLang engine is sent each step's requests at once; drop --{flag}")
    name = flag[len("sglang-"):].replace("-", "_")
    return ValueError(f"--{flag}: slime passes --sglang-* flags to SGLang's server arguments; here they are "
                      f"rl.rollout.sglang_engine_args, e.g. 'rl.rollout.sglang_engine_args={{{name}: VALUE}}' (an "
                      f"argument of sglang.Engine, checked when the engine starts)")

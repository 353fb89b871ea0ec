"""slime's KL-loss flags against this trainer's KL penalty (``rl.loss.kl_coef``, ``rl.loss.kl_estimator``).

slime adds ``--kl-loss-coef`` × its per-token KL estimator (``--kl-loss-type``) to the loss only with the switch
``--use-kl-loss``; here the penalty is on whenever ``rl.loss.kl_coef > 0``, with no switch of its own.

* ``--kl-loss-coef C`` sets ``rl.loss.kl_coef`` (:data:`~megatron_logra.megatron_flags.MEGATRON_ALIASES`); given
  above 0 without ``--use-kl-loss`` (where slime would add no KL loss) it logs that the penalty is on here
  (:func:`note_kl_loss_coef`).
* ``--use-kl-loss`` (:func:`check_use_kl_loss`) is accepted with a logged note when the config has a weight for
  the penalty: ``rl.loss.kl_coef > 0`` (the penalty is on; the switch sets nothing more), or ``--kl-loss-coef 0`` /
  ``rl.loss.kl_coef=0`` given with it (off, as slime's loss; slime would still log the KL, which needs the
  reference model this trainer builds only for a penalty). Alone it is refused, naming ``rl.loss.kl_coef``: the
  switch cannot turn a penalty of weight 0 on.
* ``--kl-loss-type`` (:func:`kl_loss_type`) sets ``rl.loss.kl_estimator``, slime's estimators being this
  trainer's of the same names: ``k2`` (``(log π_θ − log π_ref)²/2``), ``k3`` (``exp(x) − x − 1``, x =
  ``log π_ref − log π_θ``) and ``low_var_kl`` (k3 clamped to [−10, 10] per token). ``k1`` (slime's default,
  ``log π_θ − log π_ref``) is refused naming ``k2``: as a loss term k1's
  expected gradient on the policy's own samples is zero, so this trainer refuses it (README), and k2's gradient
  is that of KL(π_θ ‖ π_ref), which k1 estimates.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Collection, Iterable

if TYPE_CHECKING:
    from megatron_logra.config.run import RunConfig

__all__ = ["kl_loss_type", "check_use_kl_loss", "note_kl_loss_coef"]

logger = logging.getLogger(__name__)

_SAME = ("k2", "k3", "low_var_kl")
"""slime's ``--kl-loss-type`` values whose estimator is this trainer's ``rl.loss.kl_estimator`` of that name."""


def kl_loss_type(raw: Any) -> str:
    """The ``rl.loss.kl_estimator`` of slime's ``--kl-loss-type raw``; a ``ValueError`` naming the nearest
    supported estimator where this trainer has no estimator of that meaning."""
    value = str(raw).strip()
    if value in _SAME:
        return value
    if value == "k1":
        raise ValueError(
            "--kl-loss-type k1 (slime's default, log π_θ - log π_ref) is refused here: as a loss term its expected "
            "gradient on the policy's own samples is zero, so it regularises nothing; the nearest is --kl-loss-type "
            "k2 (rl.loss.kl_estimator=k2: the gradient of KL(π_θ ‖ π_ref), which k1 estimates), or k3 (the default: "
            "the gradient of KL(π_ref ‖ π_θ)) and low_var_kl (k3 clamped)")
    raise ValueError(f"--kl-loss-type {value!r}: slime's values are k1, k2, k3 and low_var_kl; this trainer takes k2, "
                     f"k3 or low_var_kl (rl.loss.kl_estimator)")


def check_use_kl_loss(cfg: RunConfig, given: Collection[str]) -> None:
    """slime's ``--use-kl-loss`` against the config the other overrides leave (``given``: the dotted fields the
    command line set): accepted with a logged note when ``rl.loss.kl_coef`` is above 0 or given, else a
    ``ValueError`` naming ``rl.loss.kl_coef`` (see the module doc)."""
    if cfg.job != "rl":
        raise ValueError(f"--use-kl-loss turns on the RL job's KL penalty to the reference policy, which job="
                         f"{cfg.job} does not have; drop --use-kl-loss")
    loss = cfg.rl.loss
    if loss.kl_coef > 0:
        estimator = f"rl.loss.kl_estimator={loss.kl_estimator}"
        if "rl.loss.kl_estimator" not in given:
            estimator += " (slime's default --kl-loss-type k1 is refused here; --kl-loss-type k2 or k3 chooses)"
        logger.warning("--use-kl-loss is accepted: the KL penalty is on here because rl.loss.kl_coef=%g > 0 "
                       "(--kl-loss-coef), and the switch sets nothing more; its estimator is %s", loss.kl_coef,
                       estimator)
    elif "rl.loss.kl_coef" in given:
        logger.warning("--use-kl-loss is accepted with rl.loss.kl_coef=0 (--kl-loss-coef 0): no KL penalty, as in "
                       "slime's loss, but no ref_kl is logged either (this trainer builds the reference model only "
                       "for a penalty, rl.loss.kl_coef > 0)")
    else:
        raise ValueError("--use-kl-loss turns on slime's KL loss, whose weight here is rl.loss.kl_coef, 0 in this "
                         "config (the penalty is on when rl.loss.kl_coef > 0; no switch turns it on): give "
                         "--kl-loss-coef C (rl.loss.kl_coef=C) with C > 0, or drop --use-kl-loss")


def note_kl_loss_coef(cfg: RunConfig, flags: Iterable[str]) -> None:
    """Log that ``--kl-loss-coef C > 0`` turns the penalty on here when ``flags`` (the command line's flag names)
    hold no ``--use-kl-loss``, without which slime adds no KL loss."""
    flags = set(flags)
    if cfg.job == "rl" and "kl-loss-coef" in flags and "use-kl-loss" not in flags and cfg.rl.loss.kl_coef > 0:
        logger.warning("--kl-loss-coef %g sets rl.loss.kl_coef, which turns the KL penalty to the reference policy "
                       "on here (and builds the reference model); slime adds it only with --use-kl-loss",
                       cfg.rl.loss.kl_coef)

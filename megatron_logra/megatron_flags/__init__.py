"""The Megatron-LM flags that :mod:`megatron_logra.config.overrides` accepts, and what each one does here.

Every flag is in exactly one table (without its ``--``):

* :data:`MEGATRON_ALIASES`: a value flag that sets one dotted field, whatever the rest of the config;
* :data:`JOB_ALIASES`, :data:`OPTIMIZER_ALIASES`, :data:`SCHEDULE_RATIO_FLAGS`, :data:`STEP_FRACTION_FLAGS`,
  :data:`CHECK_FLAGS`: value flags
  resolved against the rest of the config after every other override (:func:`resolve_alias`);
* :data:`LOAD_FLAGS`: ``--load DIR`` and ``--loss-scale S``, which set two fields each;
* :data:`VALUE_MAPS`: value flags whose values are spelt otherwise here (slime's ``--kl-loss-type``), mapped by
  :func:`map_value`;
* :data:`MEGATRON_FLAGS`: switches (no value) that set a field (or, for :data:`SWITCH_DEFAULTS` and
  :data:`CHECK_SWITCHES`, are resolved later);
* :data:`IGNORED_SWITCHES`, :data:`IGNORED_VALUE_FLAGS`: flags whose setting is already in effect here or has
  no counterpart that would change the run: accepted, with a logged warning saying why;
* :data:`NEUTRAL_FLAGS`: flags accepted (and ignored) at the one value that matches this trainer, refused at
  any other;
* :data:`REFUSED_SWITCHES`, :data:`REFUSED_VALUE_FLAGS`: well-known flags this trainer cannot honour, refused
  with what to use instead.

Any other ``--name`` that is not a dotted config field is refused by :func:`unknown_flag_error`, naming the
closest flags and fields (:func:`suggestions`); it never takes the next argument as its value.

Modules, each importing only those above it (and :mod:`megatron_logra.config` only inside functions: that
package imports this one while it loads):

* :mod:`~megatron_logra.megatron_flags.mapped`: the tables of flags that set or check config fields, and
  :data:`CONTEXT_FLAGS`;
* :mod:`~megatron_logra.megatron_flags.unmapped`: the ignored, neutral and refused flags;
* :mod:`~megatron_logra.megatron_flags.kl_loss`: slime's KL-loss flags (``--use-kl-loss``, ``--kl-loss-type``,
  ``--kl-loss-coef``) against ``rl.loss.kl_coef`` / ``rl.loss.kl_estimator``;
* :mod:`~megatron_logra.megatron_flags.resolve`: :func:`resolve_alias`, :func:`schedule_ratio`,
  :func:`step_fraction`, :func:`check_flag`,
  :func:`check_switch`, :func:`neutral_flag`, :func:`map_value`;
* :mod:`~megatron_logra.megatron_flags.suggest`: :func:`known_flags`, :func:`suggestions`,
  :func:`unknown_flag_error`.
"""

from megatron_logra.megatron_flags.mapped import (CHECK_FLAGS, CHECK_SWITCHES, CONTEXT_FLAGS, JOB_ALIASES, LOAD_FLAGS,
                                                  MEGATRON_ALIASES, MEGATRON_FLAGS, OPTIMIZER_ALIASES,
                                                  SCHEDULE_RATIO_FLAGS, STEP_FRACTION_FLAGS, SWITCH_DEFAULTS,
                                                  VALUE_MAPS)
from megatron_logra.megatron_flags.unmapped import (IGNORED_SWITCHES, IGNORED_VALUE_FLAGS, NEUTRAL_FLAGS,
                                                    REFUSED_SWITCHES, REFUSED_VALUE_FLAGS)
from megatron_logra.megatron_flags.kl_loss import note_kl_loss_coef
from megatron_logra.megatron_flags.resolve import (check_flag, check_switch, map_value, neutral_flag, resolve_alias,
                                                   schedule_ratio, step_fraction)
from megatron_logra.megatron_flags.suggest import known_flags, suggestions, unknown_flag_error

__all__ = ["MEGATRON_ALIASES", "JOB_ALIASES", "OPTIMIZER_ALIASES", "SCHEDULE_RATIO_FLAGS", "STEP_FRACTION_FLAGS",
           "CHECK_FLAGS", "SWITCH_DEFAULTS", "CHECK_SWITCHES", "MEGATRON_FLAGS", "LOAD_FLAGS", "IGNORED_SWITCHES",
           "IGNORED_VALUE_FLAGS", "NEUTRAL_FLAGS", "REFUSED_SWITCHES", "REFUSED_VALUE_FLAGS", "VALUE_MAPS",
           "CONTEXT_FLAGS", "resolve_alias", "schedule_ratio", "step_fraction", "check_flag", "check_switch",
           "neutral_flag", "map_value", "note_kl_loss_coef",
           "known_flags", "suggestions", "unknown_flag_error"]

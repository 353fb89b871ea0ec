"""Run configuration: each component's dataclass composed into :class:`RunConfig`, the named recipes, their
(de)serialisation, and building a config from a recipe name or YAML file plus command-line overrides.

Modules, each importing only those above it:

* :mod:`~megatron_logra.config.codec`: :func:`to_dict` / :func:`from_dict` (a run directory's
  ``config.yaml``) and the parsing of one value by its field's annotated type;
* :mod:`~megatron_logra.config.train`: :class:`TrainConfig`, the ``train`` section;
* :mod:`~megatron_logra.config.run`: :class:`RunConfig` and its cross-section checks;
* :mod:`~megatron_logra.config.recipes` (:data:`RECIPES`: the CPU recipes ``tiny``, ``tiny-adam``,
  ``lm-tiny``, ``lm-tiny-adam``) and :mod:`~megatron_logra.config.recipes_large` (the GPU sizes);
* :mod:`~megatron_logra.config.dotted`: dotted field names and :func:`set_dotted`;
* :mod:`~megatron_logra.config.checks`: checks of the fields a user gave, and :func:`resolve_hf_model`;
* :mod:`~megatron_logra.config.args`: a command line's override words -> items;
* :mod:`~megatron_logra.config.overrides`: :func:`apply_overrides` (dotted fields and Megatron-LM flags);
* :mod:`~megatron_logra.config.recipe_files`: :func:`load_recipe` (named recipes and YAML recipe files) and
  :func:`parse_args_to_config` (a recipe plus overrides, as the CLI calls it).

The section dataclasses of the components live in their own packages (``models.gpt``, ``optim.config``,
``rl.config``, ``kl.controller``, ``sync.config``, ...), which import nothing from this package at import time.
"""

from megatron_logra.config.codec import from_dict, to_dict
from megatron_logra.config.train import TrainConfig
from megatron_logra.config.run import RunConfig
from megatron_logra.config.recipes import RECIPES, WARM_START_TINY, lm_tiny, lm_tiny_adam, tiny, tiny_adam
from megatron_logra.config.dotted import set_dotted
from megatron_logra.config.checks import resolve_hf_model
from megatron_logra.config.overrides import apply_overrides
from megatron_logra.config.recipe_files import load_recipe, parse_args_to_config

__all__ = ["TrainConfig", "RunConfig", "RECIPES", "WARM_START_TINY", "tiny", "tiny_adam", "lm_tiny",
           "lm_tiny_adam", "to_dict", "from_dict", "load_recipe", "set_dotted", "apply_overrides",
           "resolve_hf_model", "parse_args_to_config"]

"""Checkpoint conversion between Hugging Face (Llama / Mistral / Qwen2 / Qwen3) and megatron-core layouts.

* :func:`convert_hf_to_mcore` / :func:`convert_mcore_to_hf` — streaming directory conversion
  (``megatron-logra convert ...``, ``tools/convert_checkpoint.py``).
* :func:`model_config_from_hf` / :func:`load_hf_into_model` — start a run from an HF checkpoint at
  any TP / PP (``model.hf_path``); :func:`load_mcore_into_model` — from a converted directory.

Only torch, safetensors-format files and JSON are read or written (no pickle); megatron-core and
transformers are not imported by the converters.
"""

from megatron_logra.convert.convert import convert_hf_to_mcore, convert_mcore_to_hf, parse_size
from megatron_logra.convert.load import load_hf_into_model, load_mcore_into_model
from megatron_logra.convert.spec import check_hf_config, megatron_plan, model_config_from_hf

__all__ = ["convert_hf_to_mcore", "convert_mcore_to_hf", "parse_size", "load_hf_into_model", "load_mcore_into_model",
           "model_config_from_hf", "check_hf_config", "megatron_plan"]

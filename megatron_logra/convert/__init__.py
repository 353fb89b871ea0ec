"""Checkpoint conversion between Hugging Face (Llama / Mistral / Qwen2 / Qwen3) and megatron-core layouts.

* :func:`convert_hf_to_mcore` / :func:`convert_mcore_to_hf` — streaming directory conversion
  (``megatron-logra convert ...``, ``tools/convert_checkpoint.py``).
* :func:`model_config_from_hf` / :func:`load_hf_into_model` — start a run from an HF checkpoint at
  any TP / PP (``model.hf_path``); :func:`load_mcore_into_model` — from a converted directory.

Only torch, safetensors-format files and JSON are written, and read from Hugging Face and converted
directories. A trainer checkpoint's torch.distributed.checkpoint index (``dist/.metadata``, a pickle)
is read only after :func:`megatron_logra.checkpoint.dcp_metadata.check_dcp_dir` has unpickled it with
an unpickler restricted to DCP's metadata classes, so a crafted checkpoint is refused instead of
running code; megatron-core and transformers are not imported by the converters.
"""

from megatron_logra.convert.convert import convert_hf_to_mcore, convert_mcore_to_hf, parse_size
from megatron_logra.convert.hf_checks import check_hf_config
from megatron_logra.convert.hf_config import model_config_from_hf
from megatron_logra.convert.load import load_hf_into_model, load_mcore_into_model
from megatron_logra.convert.tensor_plan import megatron_plan

__all__ = ["convert_hf_to_mcore", "convert_mcore_to_hf", "parse_size", "load_hf_into_model", "load_mcore_into_model",
           "model_config_from_hf", "check_hf_config", "megatron_plan"]

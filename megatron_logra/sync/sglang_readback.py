"""Reading the SGLang loader's records back: ``get_weights_by_name`` for the model classes that lack it.

The loader (:func:`~megatron_logra.sync.sglang_loader.sync_loader`) writes its outcome to :data:`STATE_PARAM` and a
fingerprint to :data:`FINGERPRINT_PARAM`, small CPU parameters a client reads with SGLang's
``get_weights_by_name``. :func:`serve_records` gives a model instance whose class has no such method (Qwen2,
Qwen3) one that serves these two records and nothing else; a model that has it is left as it is. Imports only
torch and the sync package (SGLang is optional).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_logra.sync.sglang_wire import FINGERPRINT_PARAM, STATE_PARAM

__all__ = ["serve_records"]


def serve_records(model: nn.Module) -> None:
    """Make :data:`STATE_PARAM` and :data:`FINGERPRINT_PARAM` readable through SGLang on every model class.

    SGLang's ``ModelRunner.get_weights_by_name`` delegates to ``model.get_weights_by_name(name,
    truncate_size, tp_size=...)`` and returns None when that raises. Only some model classes
    define it (``LlamaForCausalLM`` does; ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` do not),
    so without this the client could never read the loader's outcome back from a Qwen engine.
    Where neither the class nor the instance has the method, the instance gets one that serves
    these two records (fp32 byte values, truncated like SGLang's own) and nothing else.
    """
    if callable(getattr(model, "get_weights_by_name", None)):
        return

    def get_weights_by_name(name: str, truncate_size: int = 100, tp_size: int = 1) -> list:
        if name not in (STATE_PARAM, FINGERPRINT_PARAM):
            raise KeyError(f"{type(model).__name__} has no get_weights_by_name; the sync loader serves only "
                           f"{STATE_PARAM!r} and {FINGERPRINT_PARAM!r}, not {name!r}")
        param = dict(model.named_parameters())[name]  # KeyError before the first record: SGLang returns None
        return param.detach().to(device="cpu", dtype=torch.float32).tolist()[:truncate_size]

    model.__dict__["get_weights_by_name"] = get_weights_by_name

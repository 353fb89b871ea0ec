"""Checking the FP8 metadata a TransformerEngine layer keeps in its ``_extra_state``, before anything unpickles it.

TransformerEngine >= 2 stores ``pickle.dumps(fp8 metadata)`` as a uint8 tensor and unpickles it, unrestricted, in
``set_extra_state`` when a checkpoint is loaded. Owns the allow-list that pickle may reference
(:data:`EXTRA_STATE_GLOBALS`, the recipe classes :data:`RECIPE_GLOBALS`, resolved to inert stand-ins so the check
needs no TransformerEngine and imports nothing on the pickle's word), the unpickler that enforces it, and
:func:`check_extra_state`, which :func:`megatron_logra.checkpoint.dcp_metadata.check_dcp_dir` runs on every
``_extra_state`` byte object (:data:`TRUST_ENV` skips it for checkpoints one wrote oneself). These names stay
importable from :mod:`megatron_logra.checkpoint.dcp_metadata`.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from megatron_logra.checkpoint.integrity import CheckpointError


EXTRA_STATE_GLOBALS: dict[str, frozenset[str]] = {
    "builtins": frozenset({"set", "frozenset", "list", "dict", "tuple", "bytearray", "complex", "slice", "object"}),
    "collections": frozenset({"OrderedDict"}),
    "copyreg": frozenset({"_reconstructor"}),  # plain objects (dataclasses) without __reduce__
    "torch": frozenset({"Size", "device"}),  # and dtypes
    "torch._utils": frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter"}),
    "torch.storage": frozenset({"_load_from_bytes", "UntypedStorage", "TypedStorage"}),
}
"""``module: names`` the payload of a TransformerEngine layer's ``_extra_state`` may reference (its FP8
metadata: a dict of tensors and numbers, and the FP8 recipe: :data:`RECIPE_GLOBALS`); everything else is
refused."""

_TE_RECIPE_MODULE = "transformer_engine.common.recipe"
RECIPE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [(_TE_RECIPE_MODULE, name) for name in (
        "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
        "NVFP4BlockScaling", "CustomRecipe", "Format", "_FormatHelper", "_OverrideLinearPrecision", "MMParams",
        "QParams")]
    + [("megatron.core.extensions.transformer_engine", "TEDelayedScaling")])
"""The recipe classes FP8 metadata holds, by name: TransformerEngine's recipes and the enums and named tuples
of their fields, and megatron-core's own ``DelayedScaling`` subclass, which it passes for
``fp8_recipe=delayed`` (TransformerEngine pickles the recipe it was given). Only these names: a pickle may
name any attribute of the recipe module (its imported ``os`` too, or ``os.system`` through a dotted name),
which TransformerEngine's own unpickling would resolve."""


class _RecipeStandIn:
    """What a recipe class resolves to while the metadata is checked: it takes any arguments and state and
    runs nothing, so the check needs no TransformerEngine (a CPU conversion of an FP8 checkpoint) and imports
    no module on the pickle's word. TransformerEngine unpickles the real classes when it loads the layer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _recipe_stand_in(module: str, name: str) -> type:
    return type(name, (_RecipeStandIn,), {"__module__": module, "__qualname__": name})


TRUST_ENV = "MEGATRON_LOGRA_TRUST_FP8_METADATA"
"""Set to ``1`` to skip :func:`check_extra_state` for checkpoints you wrote yourself (TransformerEngine
versions whose FP8 metadata pickles other globals)."""


def _safe_load_from_bytes(b: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (how a pickled tensor's storage comes back), with
    ``weights_only=True`` where torch uses ``False``."""
    import torch

    return torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)


class _ExtraStateUnpickler(pickle.Unpickler):
    """Resolves only :data:`EXTRA_STATE_GLOBALS`, torch dtypes, and the recipe classes (to stand-ins)."""

    def __init__(self, fh, where: str) -> None:
        super().__init__(fh)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch.storage" and name == "_load_from_bytes":
            return _safe_load_from_bytes
        if (module, name) in RECIPE_GLOBALS:
            return _recipe_stand_in(module, name)
        if (name in EXTRA_STATE_GLOBALS.get(module, ())
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self._where} holds a pickle (TransformerEngine's FP8 metadata format) that references the Python "
            f"global {module}.{name}, which FP8 metadata never holds; refusing to load it, since TransformerEngine "
            "would unpickle it and that could run code: the checkpoint was not written by this trainer (crafted "
            f"or from another program). If you wrote it yourself (another TransformerEngine version), "
            f"{TRUST_ENV}=1 skips this check of FP8 metadata")


def check_extra_state(obj: Any, where: str) -> None:
    """Check the ``_extra_state`` of a TransformerEngine layer as loaded by ``torch.load(weights_only=True)``:
    TransformerEngine >= 2 stores ``pickle.dumps(fp8 metadata)`` as a uint8 tensor (megatron-core saves it as
    ``torch.save([tensor])``) and unpickles it in ``set_extra_state``; every non-empty uint8 tensor in ``obj``
    is unpickled here with :class:`_ExtraStateUnpickler` first. :class:`CheckpointError` naming ``where``
    for a refused global or bytes that are no pickle."""
    import torch

    if os.environ.get(TRUST_ENV) == "1":
        return
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, torch.Tensor) and item.dtype == torch.uint8 and item.numel():
            raw = item.detach().cpu().contiguous().numpy().tobytes()
            try:
                _ExtraStateUnpickler(io.BytesIO(raw), where).load()
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - not a pickle, truncated, ...
                raise CheckpointError(f"{where} holds {len(raw)} bytes of extra state that do not unpickle as FP8 "
                                      f"metadata ({type(exc).__name__}: {exc}); crafted or corrupt") from exc

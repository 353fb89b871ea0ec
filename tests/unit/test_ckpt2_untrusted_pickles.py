"""A checkpoint whose pickles would run code is refused before anything unpickles them.

torch.distributed.checkpoint stores its index (``dist/.metadata``) as a pickle and the byte objects
(megatron-core's ``_extra_state``) as ``torch.save`` payloads it reloads with ``weights_only=False``.
Each test crafts a copy of a real tiny checkpoint the way anyone handing out a checkpoint could (a
payload whose unpickling writes a marker file, with meta.json's sizes, CRC-32s and ``meta_crc32``
recomputed) and checks that resuming (``load_checkpoint``), the plain reader (``PlainCheckpoint``)
and the Hugging Face export reader (``McoreCheckpoint``) refuse it with a ``CheckpointError`` naming
the file, and that the marker was never written. The untouched checkpoint still loads exactly.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_logra.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_logra.checkpoint.dcp_metadata import read_dcp_metadata
from megatron_logra.checkpoint.integrity import file_crc32, meta_crc32
from megatron_logra.checkpoint.plain import PlainCheckpoint
from test_checkpoint_checksums import MODEL, _model, _weights


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


@pytest.fixture(scope="module")
def saved(groups, tmp_path_factory):
    model = _model(groups, seed=3)
    path = save_checkpoint(tmp_path_factory.mktemp("ckpt") / "run", 1, model, None, groups,
                           config={"model": dataclasses.asdict(MODEL)})
    return path, _weights(model)


class _Payload:
    """Unpickles by running ``code`` (through ``exec``), as a crafted checkpoint would."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


class _MetadataPayload:
    """Unpickles by running ``code``, then evaluates to the genuine metadata (so a load carries on)."""

    def __init__(self, code: str, real: bytes):
        self.code, self.real = code, real

    def __reduce__(self):
        return eval, (f"(exec({self.code!r}), __import__('pickle').loads({self.real!r}))[1]",)


def _marker_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('code ran during checkpoint load')"


def _reseal(ckpt: Path) -> None:
    """Recompute meta.json's sizes, CRC-32s and own CRC-32 after files were changed."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for rel in meta["files"]:
        n, crc = file_crc32(ckpt / rel)
        meta["files"][rel] = {"bytes": n, "crc32": crc}
    meta["meta_crc32"] = meta_crc32(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=1))


def _copy(saved, tmp_path: Path) -> Path:
    dst = tmp_path / "evil" / "checkpoints" / saved[0].name
    shutil.copytree(saved[0], dst)
    return dst


def _refused_everywhere(ckpt: Path, marker: Path, groups, needle: str) -> None:
    from megatron_logra.convert.mcore_checkpoint import McoreCheckpoint

    fresh = _model(groups, seed=11)
    before = _weights(fresh)
    for what, open_it in (("load_checkpoint", lambda: load_checkpoint(ckpt, fresh, None, groups)),
                          ("PlainCheckpoint", lambda: PlainCheckpoint(ckpt)),
                          ("McoreCheckpoint", lambda: McoreCheckpoint(ckpt))):
        with pytest.raises(CheckpointError) as info:
            try:
                open_it()
            finally:
                assert not marker.exists(), f"{what}: the checkpoint's payload ran"
        assert needle in str(info.value) and "could run code" in str(info.value), (what, str(info.value))
    assert all(torch.equal(v, before[k]) for k, v in _weights(fresh).items())


def test_real_checkpoint_loads_and_its_index_reads_with_the_restricted_unpickler(saved, groups):
    path, weights = saved
    md = read_dcp_metadata(path / "dist")
    assert md.state_dict_metadata.keys() == pickle.loads((path / "dist" / ".metadata").read_bytes()).state_dict_metadata.keys()
    fresh = _model(groups, seed=11)
    load_checkpoint(path, fresh, None, groups)
    assert all(torch.equal(v, weights[k]) for k, v in _weights(fresh).items())
    plain = PlainCheckpoint(path)
    assert torch.equal(plain.read("embedding.word_embeddings.weight"), weights["embedding.word_embeddings.weight"])


def test_index_that_runs_code_is_refused(saved, groups, tmp_path):
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "PWNED"
    index = ckpt / "dist" / ".metadata"
    index.write_bytes(pickle.dumps(_MetadataPayload(_marker_code(marker), index.read_bytes())))
    _reseal(ckpt)
    _refused_everywhere(ckpt, marker, groups, f"{index} references the Python global builtins.eval")


def _replace_byte_object(ckpt: Path, obj) -> str:
    """Point the first byte object of ``ckpt``'s genuine index at ``torch.save(obj)`` appended to its shard,
    re-sealing meta.json; returns the object's key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    index = ckpt / "dist" / ".metadata"
    md = pickle.loads(index.read_bytes())
    where, info = next((i, s) for i, s in md.storage_data.items()
                       if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata))
    buf = io.BytesIO()
    torch.save(obj, buf)
    shard = ckpt / "dist" / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as fh:
        fh.write(buf.getvalue())
    md.storage_data[where] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    index.write_bytes(pickle.dumps(md))
    _reseal(ckpt)
    return where.fqn


def test_byte_object_that_runs_code_is_refused(saved, groups, tmp_path):
    """The index is genuine, but one ``_extra_state`` byte object now points at a payload appended to a shard."""
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "PWNED"
    where = _replace_byte_object(ckpt, _Payload(_marker_code(marker)))
    _refused_everywhere(ckpt, marker, groups, f"byte object {where!r} does not load as plain data")


def test_truncated_index_is_named(saved, tmp_path):
    dist = _copy(saved, tmp_path) / "dist"
    data = (dist / ".metadata").read_bytes()
    (dist / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata is not a readable torch\.distributed\.checkpoint index"):
        read_dcp_metadata(dist)


def _te_extra_state(state) -> torch.Tensor:
    """What a TransformerEngine >= 2 layer's ``get_extra_state`` returns: its pickled FP8 metadata as uint8."""
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def test_transformer_engine_extra_state_that_runs_code_is_refused(saved, groups, tmp_path):
    """megatron-core saves a TE layer's ``_extra_state`` as ``torch.save([uint8 tensor])``: plain data to
    ``weights_only=True``, but TE unpickles the tensor's bytes on load. The payload inside is checked too."""
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "PWNED"
    payload = [_te_extra_state(_Payload(_marker_code(marker)))]
    buf = io.BytesIO()
    torch.save(payload, buf)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # what the outer check alone let through
    assert "_extra_state" in _replace_byte_object(ckpt, payload)
    _refused_everywhere(ckpt, marker, groups, "references the Python global builtins.exec")


def test_transformer_engine_fp8_metadata_passes_the_extra_state_check(monkeypatch):
    """Genuine FP8 metadata (tensors, numbers and the recipe dataclass of ``transformer_engine.common.recipe``,
    here a stand-in registered under that module name) is accepted; bytes that are no pickle are refused."""
    import enum
    import sys
    import types

    from megatron_logra.checkpoint.dcp_metadata import check_extra_state

    recipe = types.ModuleType("transformer_engine.common.recipe")

    class Format(enum.Enum):
        E4M3 = "e4m3"
        HYBRID = "hybrid"

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024

    for cls in (Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = recipe.__name__, cls.__name__
        setattr(recipe, cls.__name__, cls)
    for name in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, recipe.__name__, recipe)
    state = {"recipe": DelayedScaling(), "scale_fwd": torch.ones(3), "scale_inv_fwd": torch.ones(3),
             "amax_history_fwd": torch.zeros(4, 3), "extra_fp8_variables": {"num_gemms": 1, "fp8_max_fwd": 448.0}}
    check_extra_state([_te_extra_state(state)], "layer")
    check_extra_state([None], "layer")
    check_extra_state([torch.empty(0, dtype=torch.uint8)], "layer")
    with pytest.raises(CheckpointError, match="do not unpickle as FP8 metadata"):
        check_extra_state([torch.tensor([1, 2, 3], dtype=torch.uint8)], "layer")


def test_megatrons_delayed_scaling_recipe_passes_without_transformer_engine(monkeypatch):
    """``fp8_recipe=delayed``: megatron-core hands TransformerEngine its own ``TEDelayedScaling`` (a subclass of
    TE's ``DelayedScaling`` in ``megatron.core.extensions.transformer_engine``), which TE pickles into every
    layer's metadata. The check accepts it, and checks without importing TransformerEngine (not installed on
    a CPU that converts the checkpoint): the stand-in modules are gone before it runs."""
    import enum
    import sys
    import types

    import megatron.core.extensions.transformer_engine as mcore_te

    from megatron_logra.checkpoint.dcp_metadata import check_extra_state

    recipe = types.ModuleType("transformer_engine.common.recipe")

    class Format(enum.Enum):
        HYBRID = "hybrid"

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID

    class TEDelayedScaling(DelayedScaling):
        pass

    for cls in (Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = recipe.__name__, cls.__name__
        setattr(recipe, cls.__name__, cls)
    TEDelayedScaling.__module__, TEDelayedScaling.__qualname__ = mcore_te.__name__, "TEDelayedScaling"
    monkeypatch.setattr(mcore_te, "TEDelayedScaling", TEDelayedScaling)

    class NotARecipe:  # any other global of that module is still refused
        pass

    NotARecipe.__module__, NotARecipe.__qualname__ = mcore_te.__name__, "NotARecipe"
    monkeypatch.setattr(mcore_te, "NotARecipe", NotARecipe, raising=False)
    for name in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, recipe.__name__, recipe)
    payload = _te_extra_state({"recipe": TEDelayedScaling(margin=1), "scale_fwd": torch.ones(3)})
    bad = _te_extra_state({"recipe": NotARecipe()})
    for name in ("transformer_engine", "transformer_engine.common", recipe.__name__):
        monkeypatch.delitem(sys.modules, name)
    check_extra_state([payload], "layer")
    assert recipe.__name__ not in sys.modules
    with pytest.raises(CheckpointError, match="megatron.core.extensions.transformer_engine.NotARecipe"):
        check_extra_state([bad], "layer")


@pytest.mark.parametrize("name", ["os.system", "os", "dataclass", "DelayedScaling.__init__"])
def test_only_the_recipe_classes_of_the_recipe_module_are_accepted(name):
    """TE's own unpickling resolves any attribute of ``transformer_engine.common.recipe``, through dots too
    (protocol 4): its imported ``os`` gives ``os.system``. The check accepts recipe classes by name only."""
    from megatron_logra.checkpoint.dcp_metadata import check_extra_state

    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    # PROTO 4, module, name, STACK_GLOBAL, an argument, TUPLE1, REDUCE, STOP: call recipe.<name>("true")
    payload = b"\x80\x04" + text("transformer_engine.common.recipe") + text(name) + b"\x93" + text("true") + b"\x85R."
    with pytest.raises(CheckpointError, match=f"transformer_engine.common.recipe.{name}"):
        check_extra_state([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], "layer")

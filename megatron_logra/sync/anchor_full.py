"""Full-weights files of a delta directory: the producer writes the refit's weights next to its anchor
marker, a consumer reloads them into its engine and so verifies that anchor.

With a refit's anchor the producer writes the refit's full weights, ``full_{version:08d}.safetensors``
(the file format is :mod:`megatron_logra.sync.full_weights`), and the marker names it with its sha256
(:meth:`~megatron_logra.sync.anchor_markers._AnchorMarkers.write_anchor` deletes every other full-weights
file). A consumer refused at an anchor, or at a ``gap``, reloads them with :meth:`_FullWeightsFiles.load_full`:
checksum first, then the file's shapes against the engine, so a file the engine cannot hold changes nothing;
the anchor it counts as verified is the marker the file was opened for.

Imports only torch, safetensors (via the full-weights reader) and the standard library.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from megatron_logra.sync.anchor_markers import _AnchorMarkers
from megatron_logra.sync.engine import full_shape_problems
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.full_weights import FullWeightsReader, FullWeightsWriter

logger = logging.getLogger(__name__)


class _FullWeightsFiles(_AnchorMarkers):
    """A delta directory's full-weights files (producer: ``full_writer``, ``write_full``; consumer:
    ``open_full``, ``load_full``) on top of its anchor markers."""

    def full_writer(self, version: int, specs: Sequence[tuple[str, Sequence[int]]],
                    dtype: torch.dtype, vocab_rows: Optional[int] = None) -> FullWeightsWriter:
        """Producer: a writer of ``full_<version>.safetensors``, the trainer's full weights at ``version`` in
        HF names and the engine's ``dtype``; ``specs`` lists every ``(name, shape)`` in the order
        :meth:`FullWeightsWriter.add` will receive them; ``vocab_rows``: the model's vocabulary, to which the
        vocabulary-parallel tensors are cut (:class:`FullWeightsWriter`). Pass what
        :meth:`FullWeightsWriter.finish` returns to :meth:`write_anchor` (``full=``): the marker then names the
        file and its checksum."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SyncError("config", f"full-weights version must be an int >= 0, got {version!r}")
        return FullWeightsWriter(self.dir, version, specs, dtype, vocab_rows)

    def write_full(self, version: int, tensors: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                   dtype: Optional[torch.dtype] = None, vocab_rows: Optional[int] = None) -> Optional[dict]:
        """Producer: write ``tensors`` (a mapping; or ``(name, tensor)`` pairs, then held in memory to list
        them first) as the full weights at ``version`` in ``dtype`` (None: the first tensor's; ``vocab_rows``:
        see :meth:`full_writer`); returns what :meth:`FullWeightsWriter.finish` does. A trainer streaming its
        weights uses :meth:`full_writer`."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        if dtype is None:
            dtype = items[0][1].dtype if items else torch.float32
        writer = self.full_writer(version, [(n, list(t.shape)) for n, t in items], dtype, vocab_rows)
        for name, t in items:
            writer.add(name, t)
        return writer.finish()

    def open_full(self, version: Optional[int] = None) -> "FullWeightsReader":
        """Consumer: open and verify (sha256, and that it is the file the anchor marker names) the full-weights
        file of the anchor at ``version`` (None: the newest anchor). Returns a context manager whose
        ``tensors()`` yields ``(HF name, tensor)`` one at a time and ``shapes()`` lists them, for engines that
        load weights themselves (:meth:`load_full` does it for engines with ``update_weights_full``); its
        ``anchor`` is the marker the file was opened for (what to verify once the tensors are loaded: a
        marker written at the same version meanwhile belongs to other weights). Raises ``SyncError``
        (``anchor`` when that anchor has no full-weights file)."""
        anchor = self._anchor_for(version)
        full = anchor.get("full")
        if full is None:
            raise SyncError("anchor", f"the anchor at version {anchor['version']} has no full-weights file in "
                                      f"{self.dir} (the producer wrote none, e.g. a chain start before its first "
                                      "refit or a failed write): reload the trainer's weights at that version by other "
                                      f"means and call accept_anchor({anchor['version']})")
        reader = FullWeightsReader(self._full_path(full), anchor["version"], full["sha256"])
        reader.anchor = anchor
        return reader

    def load_full(self, engine: Any, version: Optional[int] = None) -> dict:
        """Consumer: load the full weights of the anchor at ``version`` (None: the newest) into ``engine`` with
        its ``update_weights_full(stream, version)`` (one tensor at a time), which sets its ``weight_version``,
        then count the anchor whose file was read as verified and return its marker. The remedy the
        ``anchor`` and ``gap`` errors of :meth:`consume` name. The file's sha256 is verified before the first
        tensor reaches the engine; an engine's refusal is raised as ``SyncError("apply")``.

        The file's names and shapes are checked against the engine before the first tensor is copied, so a file
        the engine cannot hold leaves its weights and version untouched (``SyncError("shape")``): by the
        engine's ``check_full_shapes(shapes)`` when it has one (:class:`~megatron_logra.sync.engine.
        ModuleEngine`: an engine holding more vocabulary rows than the file, e.g. padded ones, takes the file's
        rows as its first rows), else against its ``expected_shapes()`` exactly, when it lists them. The file
        holds the model's vocabulary (``model.vocab_size`` rows of ``embed_tokens``/``lm_head``, the header's
        ``vocab_rows``), as the model's HF checkpoint does.

        The anchor verified is the marker the file was opened for, never one found at that version after the
        load: a producer that restarts and refits at the same version while the file is streamed writes a new
        marker (another epoch, other weights), which stays unverified, so the next :meth:`consume` refuses at
        it and the consumer reloads."""
        load = getattr(engine, "update_weights_full", None)
        if not callable(load):
            raise SyncError("config", f"{type(engine).__name__} has no update_weights_full(stream, version): load "
                                      "the tensors of open_full() yourself, then call accept_anchor")
        with self.open_full(version) as reader:
            check, expected = getattr(engine, "check_full_shapes", None), getattr(engine, "expected_shapes", None)
            if callable(check):
                check(reader.shapes())
            elif callable(expected):
                problems = full_shape_problems(reader.shapes(), expected())
                if problems:
                    rows = "" if reader.vocab_rows is None else f"; the file holds {reader.vocab_rows} vocabulary rows"
                    raise SyncError("shape", f"{reader.path.name} does not fit the {type(engine).__name__} "
                                             f"({len(problems)} tensors, e.g. {problems[:4]}{rows}): nothing was "
                                             "loaded")
            try:
                load(reader.tensors(), reader.version)
            except SyncError:
                raise
            except (ValueError, RuntimeError) as exc:
                raise SyncError("apply", f"the engine refused {reader.path.name}: {exc}") from exc
        anchor = reader.anchor
        self._remember(anchor["epoch"])
        logger.info("engine reloaded the full weights at version %d from %s", reader.version, reader.path.name)
        return anchor

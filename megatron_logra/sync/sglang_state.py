"""Loader commands and the loader state an SGLang target reads back, across data-parallel replicas.

SGLang reports success whatever the sketch-delta loader decided (the loader must not raise, see
:mod:`~megatron_logra.sync.sglang_loader`), so every command carries a fresh nonce and the target
reads the loader's recorded outcome back with ``get_weights_by_name(STATE_PARAM)``: the nonce says
the loader really ran this request, ``ok`` / ``error_kind`` / ``version`` what it decided. At
``dp_size > 1`` every data-parallel rank answers: their records must agree on
:data:`_REPLICA_KEYS`, else :class:`SGLangError` ``engine`` names the ranks and what differs, so a
rank that missed an update is never hidden behind the first one's answer (only a non-strict read,
the first :attr:`~megatron_logra.sync.sglang_protocol._SGLangTarget.weight_version`, reports
version -1 instead, so such an engine can still be refit).

Vocabulary: the trainer pads its vocabulary (``ModelConfig.padded_vocab_size``); the served model
may not (a server started from the Hugging Face checkpoint or the exported config has the
tokenizer's ``vocab_size``). SGLang's ``VocabParallelEmbedding.weight_loader`` asserts that a
loaded ``embed_tokens``/``lm_head`` has exactly ``org_vocab_size`` rows, so refits and the dense
vocabulary entries of deltas are cut to the engine's vocabulary (:attr:`_SGLangLoaderState.vocab_size`, which
the loader reports): the rows past it are padding the trainer masks, which the engine does
not have. A tensor with *fewer* rows than the engine's vocabulary is refused before it is sent.

Imports only torch and the standard library besides the sync package.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Optional

import torch

from megatron_logra.sync.codec import SketchDelta, encode
from megatron_logra.sync.sglang_payloads import SGLangError, _decode_json_param, _replica_answers
from megatron_logra.sync.sglang_primitives import _SGLangPrimitives
from megatron_logra.sync.sglang_weights import VOCAB_PARALLEL
from megatron_logra.sync.sglang_wire import LOADER_PATH, STATE_PARAM, command_as_named_tensors

logger = logging.getLogger(__name__)

_REPLICA_KEYS = ("format", "nonce", "op", "ok", "error_kind", "version", "vocab_size", "fingerprint_version")
"""The loader-state fields every data-parallel rank must report alike."""


class _SGLangLoaderState(_SGLangPrimitives):
    """Loader commands (nonce, send, read back), the replicas' merged loader state, the engine's
    version as the loader records it, and its vocabulary."""

    def _command(self, op: str, *, flush_cache: bool = False, strict: bool = True, **fields: Any) -> dict:
        """Run one loader command and return its verified state (``strict``: see :meth:`_merge_states`)."""
        nonce = secrets.token_hex(8)
        command = {"op": op, "nonce": nonce, "rows_per_tensor": self.rows_per_tensor, **fields}
        self._send(command_as_named_tensors(command), flush_cache=flush_cache, what=f"command {op!r}")
        return self._state(nonce, strict=strict)

    def _send(self, named_tensors: list, *, flush_cache: bool, what: str) -> None:
        ok, message = self._update(named_tensors, LOADER_PATH, flush_cache)
        if not ok:
            raise SGLangError("engine", f"SGLang update_weights_from_tensor failed for {what}: {message}")

    def _read_records(self, name: str, what: str) -> Optional[list[Optional[dict]]]:
        """The JSON record ``name`` of every data-parallel replica (one entry at ``dp_size == 1``; None
        for a replica without one); None when no replica has it."""
        answers = _replica_answers(self._read_param(name), self._dp_size, what)
        if answers is None:
            return None
        if len(answers) == 1:
            return [_decode_json_param(answers[0], what)]
        return [None if a is None else _decode_json_param(a, f"{what} of data-parallel replica {i}")
                for i, a in enumerate(answers)]

    def _merge_states(self, records: list[Optional[dict]], what: str, *, strict: bool = True) -> dict:
        """One loader state from every data-parallel replica's (:data:`_REPLICA_KEYS` must agree).

        Disagreeing replicas raise :class:`SGLangError` ``engine`` naming them and the differing
        fields; with ``strict=False`` the state reports version -1 (unknown) instead, unless the
        replicas disagree on the vocabulary (always an error). Differing ``error`` /
        ``fingerprint_error`` texts are joined per replica.
        """
        if len(records) == 1 and records[0] is not None:
            return records[0]
        n = len(records)
        missing = [i for i, r in enumerate(records) if r is None]
        present = [r for r in records if r is not None]
        diffs = [f"replica(s) {missing} have no {what}"] if missing else []
        vocab_differs = False
        for key in _REPLICA_KEYS:
            values = [r.get(key) for r in present]
            if any(v != values[0] for v in values):
                vocab_differs = vocab_differs or key == "vocab_size"
                diffs.append(f"{key}: " + ", ".join(f"replica {i}={r.get(key)!r}"
                                                    for i, r in enumerate(records) if r is not None))
        if diffs and (strict or vocab_differs or not present):
            raise SGLangError("engine", f"the SGLang engine's {n} data-parallel replicas disagree on the {what}: "
                                        f"{'; '.join(diffs)} -- a replica did not apply the same updates as the "
                                        "others; a full refit (update_weights_full) reaches every replica")
        state = dict(present[0])
        for key in ("error", "fingerprint_error"):
            texts = [(i, r.get(key)) for i, r in enumerate(records) if r is not None and r.get(key)]
            if len({t for _, t in texts}) > 1:
                state[key] = "; ".join(f"data-parallel replica {i}: {t}" for i, t in texts)
            elif texts:
                state[key] = texts[0][1]
        if diffs:
            logger.warning("SGLang engine's data-parallel replicas disagree (%s): its version is unknown until a "
                           "full refit", "; ".join(diffs))
            state.update(version=-1, fingerprint_version=None)
        return state

    def _state(self, nonce: Optional[str] = None, *, strict: bool = True) -> dict:
        records = self._read_records(STATE_PARAM, f"loader state {STATE_PARAM!r}")
        if records is None:
            raise SGLangError("engine", f"cannot read the loader state {STATE_PARAM!r} back with get_weights_by_name "
                                        "after the loader ran: check the engine's log for the read error (the "
                                        "loader serves the record itself on model classes without the method)")
        if nonce is not None and not strict:  # every replica ran this command, whatever else differs
            for i, r in enumerate(records):
                if r is None or r.get("nonce") != nonce:
                    where = f" on data-parallel replica {i}" if len(records) > 1 else ""
                    raise SGLangError("engine", f"the loader did not record this request{where} (state nonce "
                                                f"{r and r.get('nonce')!r}, sent {nonce!r}): was {LOADER_PATH} "
                                                "really called?")
        state = self._merge_states(records, f"loader state {STATE_PARAM!r}", strict=strict)
        self._note_vocab(state)
        if nonce is not None and state.get("nonce") != nonce:
            raise SGLangError("engine", f"the loader did not record this request (state nonce {state.get('nonce')!r}, "
                                        f"sent {nonce!r}): was {LOADER_PATH} really called?")
        return state

    def refresh(self) -> int:
        """Check the server and read the engine's version from its loader state (runs a status command
        when some replica has none yet). Data-parallel replicas that disagree raise :class:`SGLangError`."""
        return self._read_version(strict=True)

    def _read_version(self, *, strict: bool) -> int:
        self._check_server()
        records = self._read_records(STATE_PARAM, "loader state")
        if records is None or any(r is None for r in records):
            state = self._command("status", strict=strict)
        else:
            state = self._merge_states(records, "loader state", strict=strict)
        self._note_vocab(state)
        self._version = int(state["version"])
        return self._version

    def _note_vocab(self, state: dict) -> None:
        size = state.get("vocab_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            self._vocab, self._vocab_read = size, True
        if isinstance(state.get("dtype"), str):
            self._dtype = state["dtype"]

    @property
    def weight_dtype(self) -> Optional[str]:
        """The dtype of the served model's weights (``"bfloat16"``, ...) as its loader reports it with the
        vocabulary (read with :attr:`vocab_size`), None when the loader does not say."""
        self.vocab_size  # noqa: B018 - one status command the first time
        return self._dtype

    @property
    def vocab_size(self) -> Optional[int]:
        """The served model's vocabulary (``config.vocab_size``, as the loader reports it; one status
        command the first time), None when the engine's loader does not say. Refits and deltas send
        ``embed_tokens``/``lm_head`` cut to this many rows."""
        if not self._vocab_read:
            self._check_server()
            self._vocab_read = True
            self._command("status", strict=False)  # a full refit reads it: replicas may be at different versions
        return self._vocab

    def _vocab_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the engine loads it: a vocab-parallel tensor cut to the engine's vocabulary."""
        vocab = self._vocab
        if name not in VOCAB_PARALLEL or vocab is None or tensor.dim() < 1 or tensor.shape[0] == vocab:
            return tensor
        if tensor.shape[0] < vocab:
            raise SGLangError("config", f"{name} has {tensor.shape[0]} rows but the SGLang engine's model has "
                                        f"vocab_size={vocab}: the trainer's vocabulary (model.vocab_size, padded "
                                        "by model.make_vocab_size_divisible_by) must cover the served model's")
        return tensor[:vocab]  # the trainer's padding rows: masked there, absent from the engine's model

    def _delta_for_engine(self, delta: SketchDelta, data: bytes) -> tuple[SketchDelta, bytes]:
        """``delta`` with its dense vocabulary entries cut to the engine's vocabulary (re-encoded if cut)."""
        if not any(name in VOCAB_PARALLEL for name in delta.dense):
            return delta, data
        self.vocab_size  # noqa: B018 - reads the engine's vocabulary once
        dense = {name: self._vocab_rows(name, t) for name, t in delta.dense.items()}
        if all(dense[name] is t for name, t in delta.dense.items()):
            return delta, data
        delta.dense = {name: t.clone() for name, t in dense.items()}
        return delta, encode(delta)

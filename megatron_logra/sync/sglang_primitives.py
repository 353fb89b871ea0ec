"""The five transport primitives of an SGLang target, and the server checks made before anything is sent.

Contract: a transport (:mod:`~megatron_logra.sync.sglang_client`) implements ``_server_info``,
``_update`` (``update_weights_from_tensor``), ``_read_param`` (``get_weights_by_name``),
``_pause`` and ``_continue`` (and may implement ``_publish_version``); :class:`_SGLangPrimitives`
declares them, holds the target's settings and byte/time counters, and checks once, from the
server's arguments alone, that the engine registers the sketch-delta loader and has a layout
deltas can apply to -- before anything is sent, because SGLang fails inside its scheduler (which
kills the server) on what these checks refuse. :mod:`~megatron_logra.sync.sglang_state` builds
the loader commands on top, :mod:`~megatron_logra.sync.sglang_protocol` the engine protocol.

Data parallelism (``--dp-size N > 1``): SGLang accepts ``update_weights_from_tensor`` only with
``--enable-dp-attention`` (its tokenizer manager asserts ``dp_size == 1 or enable_dp_attention``),
so a server that reports ``dp_size > 1`` with ``enable_dp_attention`` false is refused before
anything is sent (``config``). With it the engine is not N copies of the model but one model over
its ``tp_size`` GPUs: attention is split over groups of ``tp_size / N`` ranks (``attn_tp``), the
embedding is unsharded, the MLP and ``lm_head`` span all ``tp_size`` ranks. The loader assumes one
TP position for the whole model, so no delta could apply: :meth:`_SGLangPrimitives.check_delta_sync`
refuses deltas before anything is sent (``config``: serve with ``--dp-size 1``, or set
``sync.mode=full``) and fingerprints are off (``None``). Dense refits go through SGLang's own
``load_weights``, which knows that layout. Their loader commands (version marks, status) run on
every rank, and ``get_weights_by_name`` answers once per data-parallel rank
(``TokenizerManager.get_weights_by_name``: the bare answer at ``dp_size == 1``, the list of
answers otherwise). The client decodes every rank's record: the loader states must agree (nonce,
op, ok, error kind, version, vocabulary, fingerprint version), else :class:`SGLangError`
``engine`` names the data-parallel ranks and what differs -- one that missed an update is never
hidden behind the first one; a full refit, which reaches every rank, brings them back together.
Only the first read of :attr:`~megatron_logra.sync.sglang_protocol._SGLangTarget.weight_version`
tolerates disagreeing ranks: it reports version -1 (unknown) so an engine left in that state can
still be refit.

Pipeline parallelism (``--pp-size N > 1``): each stage holds only its own layers (SGLang builds the
others, and ``norm``/``lm_head`` before the last stage, as parameterless ``PPMissingLayer`` modules), while
every rank receives the whole delta and must find every target it names, so
:meth:`_SGLangPrimitives.check_delta_sync` refuses deltas before anything is sent (``config``: set
``sync.mode=full``, or serve the model with ``--pp-size 1``) and fingerprints are off (``None``).
Dense refits are not refused: they go through SGLang's own ``load_weights``, which loads each stage's
layers.

Imports only torch and the standard library besides the sync package.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

import torch

from megatron_logra.sync.sglang_payloads import DEFAULT_CHUNK_BYTES, SGLangError
from megatron_logra.sync.sglang_wire import LOADER_PATH

logger = logging.getLogger(__name__)

_READ_ALL = 1 << 31  # truncate_size for get_weights_by_name: the whole (1-D) state parameter


def _int_at_least_1(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


class _SGLangPrimitives:
    """The settings, counters and server checks of an SGLang target, on the primitives each transport implements."""

    def __init__(self, *, pause: bool = True, fingerprint_on_apply: bool = True, rows_per_tensor: int = 4,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.pause = pause
        self.fingerprint_on_apply = fingerprint_on_apply
        self.rows_per_tensor = rows_per_tensor
        self.chunk_bytes = chunk_bytes
        self._version: Optional[int] = None
        self._vocab: Optional[int] = None
        self._dtype: Optional[str] = None
        self._vocab_read = False
        self._checked = False
        self._dp_size: Optional[int] = None
        self._pp_size: Optional[int] = None
        self._fp_disabled: Optional[str] = None
        self.bytes_sent = 0
        self.num_deltas = 0
        self.num_full = 0
        self.last_apply_s = 0.0
        self.last_full_s = 0.0

    # ---- primitives (transport specific) ------------------------------------------------
    def _server_info(self) -> dict:
        """The server's arguments that matter here: ``custom_weight_loader``, ``tp_size``, ``dp_size``,
        ``enable_dp_attention``, ``pp_size`` (absent keys: not known)."""
        raise NotImplementedError

    def _update(self, named_tensors: list[tuple[str, torch.Tensor]], load_format: Optional[str],
                flush_cache: bool) -> tuple[bool, str]:
        raise NotImplementedError

    def _read_param(self, name: str) -> Optional[list]:
        """SGLang's ``get_weights_by_name`` answer as it comes (at ``dp_size > 1`` one list per
        data-parallel replica), None when the engine has no such parameter."""
        raise NotImplementedError

    def _pause(self) -> None:
        raise NotImplementedError

    def _continue(self) -> None:
        raise NotImplementedError

    def _publish_version(self, version: int) -> None:
        """Tell SGLang's own ``weight_version`` (tags generations); best effort."""

    # ---- helpers --------------------------------------------------------------------------
    def _check_server(self) -> None:
        if self._checked:
            return
        info = self._server_info()
        loaders = info.get("custom_weight_loader") or []  # SGLang's default is None / []
        if "custom_weight_loader" not in info:
            logger.warning("SGLang server info has no 'custom_weight_loader' field; assuming %s is registered",
                           LOADER_PATH)
        elif LOADER_PATH not in loaders:
            raise SGLangError("config", f"the SGLang engine does not register the sketch-delta loader: start it with "
                                        f"--custom-weight-loader {LOADER_PATH} (it lists {loaders or []}); sending "
                                        "an unregistered load_format would crash its scheduler")
        dp_size = _int_at_least_1(info.get("dp_size"))
        if dp_size > 1 and info.get("enable_dp_attention") is False:
            raise SGLangError("config", f"the SGLang engine serves dp_size={dp_size} data-parallel replicas without "
                                        "--enable-dp-attention, and SGLang then refuses update_weights_from_tensor "
                                        "(its tokenizer manager asserts dp_size == 1 or enable_dp_attention): start "
                                        "it with --dp-size 1, or add --enable-dp-attention for dense refits only "
                                        "(sync.mode=full)")
        self._dp_size = dp_size
        self._pp_size = _int_at_least_1(info.get("pp_size"))
        if self._pp_size > 1 and not self._fp_disabled:
            self._fp_disabled = (f"the engine runs {self._pp_size} pipeline stages, each holding only its own "
                                 "layers, so its loader cannot hash the whole model")
        if dp_size > 1 and not self._fp_disabled:
            self._fp_disabled = (f"the engine runs dp_size={dp_size} with data-parallel attention, a layout the "
                                 "loader cannot read in HF order")
        self._checked = True

    def check_delta_sync(self) -> None:
        """Refuse (:class:`SGLangError` ``config``, before anything but the server info is read) an engine
        that cannot apply sketch deltas: one with pipeline stages (``pp_size > 1``: each stage holds only
        its own layers, while every rank receives the whole delta and needs every target it names), or
        with data-parallel ranks (``dp_size > 1``, which SGLang updates only with data-parallel attention:
        attention and MLP are then split over different TP groups, and the loader assumes one TP position
        per model; see the module docstring). Dense refits (:meth:`update_weights_full`) stay available:
        they go through SGLang's own ``load_weights``."""
        self._check_server()
        if self._pp_size is not None and self._pp_size > 1:
            raise SGLangError("config", f"the SGLang engine runs pp_size={self._pp_size} pipeline stages: each stage "
                                        "holds only its own layers, so sketch deltas (which every rank applies "
                                        "whole) cannot apply; set sync.mode=full (dense refits), or serve the "
                                        "model without pipeline parallelism (--pp-size 1)")
        if self._dp_size is not None and self._dp_size > 1:
            raise SGLangError("config", f"the SGLang engine runs dp_size={self._dp_size} with data-parallel attention: "
                                        "its attention is split over tp_size/dp_size ranks while its MLP spans all "
                                        "tp_size, a layout sketch deltas cannot be applied to; serve the model with "
                                        "--dp-size 1 (the in-process engine, rl.rollout.sglang_url empty, runs one "
                                        "engine per trainer data-parallel replica), or set sync.mode=full (dense "
                                        "refits reach every data-parallel rank)")

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        if not self.pause:
            yield
            return
        self._pause()
        try:
            yield
        finally:
            self._continue()

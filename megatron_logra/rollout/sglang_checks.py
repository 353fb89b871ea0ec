"""Start-up checks for the SGLang rollout engine: the engine's vocabulary and an in-process engine's dtype.

Both are refused with a ``ValueError`` naming the setting to change, before any rollout: a vocabulary
outside ``[vocab_size, padded_vocab_size]`` cannot be synced or scored (:func:`check_engine_vocab`), and
a float32 in-process engine would fail in its first forward, after start-up (:func:`check_engine_dtype`).
They import nothing from SGLang, so the trainer runs them before it builds anything
(``rl.components``).
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_DTYPES", "check_engine_dtype", "check_engine_vocab", "engine_dtype_mismatch"]


def check_engine_vocab(engine_vocab: Optional[int], vocab_size: int, padded_vocab_size: int) -> int:
    """The engine's vocabulary ``E`` (``padded_vocab_size`` when its loader does not say), refused
    (``ValueError``) outside ``[vocab_size, padded_vocab_size]``: a smaller model lacks tokens the
    trainer samples; a larger one has ids the trainer cannot score, and SGLang's embedding loader
    takes exactly ``E`` rows, which the trainer's refits do not have."""
    if engine_vocab is None:
        return padded_vocab_size
    if not vocab_size <= engine_vocab <= padded_vocab_size:
        raise ValueError(
            f"the SGLang engine's model has vocab_size={engine_vocab}, the trainer model.vocab_size={vocab_size} "
            f"padded to {padded_vocab_size} (model.make_vocab_size_divisible_by x TP): the engine's vocabulary must "
            f"lie in [{vocab_size}, {padded_vocab_size}]; serve a model whose config has vocab_size={vocab_size} "
            f"(the Hugging Face checkpoint, or what `convert mcore-to-hf` writes) or {padded_vocab_size}, or set model.vocab_size "
            "to the served model's")
    return int(engine_vocab)


ENGINE_DTYPES = ("bfloat16", "float16")
"""``model.params_dtype`` values an in-process engine runs in."""


def check_engine_dtype(params_dtype: str) -> None:
    """Refuse a ``model.params_dtype`` an in-process ``sglang.Engine`` cannot run in (``ValueError``).

    The engine is started in the trainer's dtype (sketch deltas merge bit for bit on both sides), and
    SGLang's CUDA kernels (``sgl_kernel`` RMSNorm, fused RoPE) are dispatched for float16 / bfloat16
    only: a float32 engine fails in its first forward, after start-up. A server (``rl.rollout.
    sglang_url``) runs in the dtype it was started with: :func:`engine_dtype_mismatch` names a difference.
    """
    if str(params_dtype) not in ENGINE_DTYPES:
        raise ValueError(
            f"model.params_dtype={params_dtype!r}: an in-process SGLang engine (rl.rollout.engine=sglang without "
            f"rl.rollout.sglang_url) runs in the trainer's dtype, and SGLang's CUDA kernels are built for float16 "
            f"and bfloat16 only; set model.params_dtype=bfloat16 (--bf16), or use rl.rollout.engine=embedded")


def engine_dtype_mismatch(engine_dtype: Optional[str], trainer_dtype: Optional[str]) -> Optional[str]:
    """Why an engine whose weights are ``engine_dtype`` (as its sync loader reports them; None: not known) cannot
    stay bitwise equal to a trainer in ``trainer_dtype`` (``model.params_dtype``), or None when they agree.

    Refits and sketch deltas reach the engine cast to its own dtype, while the drift check compares its
    weights with the trainer's in the trainer's dtype: with different dtypes every check finds drift and
    refits densely (a server keeps the dtype it was started with, ``--dtype``)."""
    if engine_dtype is None or trainer_dtype is None or str(engine_dtype) == str(trainer_dtype):
        return None
    fix = f"set model.params_dtype={engine_dtype}"
    if str(trainer_dtype) in ENGINE_DTYPES:  # SGLang's CUDA kernels run 16-bit weights only
        fix = f"start the server with --dtype {trainer_dtype}, or {fix}"
    return (f"the SGLang engine holds its weights in {engine_dtype}, the trainer in model.params_dtype={trainer_dtype}: "
            f"its weights cannot match the trainer's bit for bit, so every drift check (sync.check_interval) will "
            f"find drift and refit densely; {fix}")

"""Errors of ``tools/memory_stress.py`` in its own flags.

The script builds a ``ModelConfig`` from ``--hidden``, ``--heads``, ``--query-groups``, ``--ffn``, ... (or resolves
``--model``) and asks the memory planner whether ``--tp`` and ``--rank`` fit it. Those shared checks speak in
config fields (``model.hidden_size=63 must be divisible by model.num_attention_heads=4, or set model.kv_channels``),
as ``megatron-logra train`` users need them, and they stay so. :func:`flag_error` rewrites such a message for the
script's user: it names the flags they typed with the values they gave (``--hidden=63``), marks a value the script
filled in as a default, and proposes a fix the script can take (it has no ``--kv-channels``, for one), so that
``memory_stress.py: error: ...`` can be acted on without reading the trainer's config reference.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Collection

__all__ = ["flag_error", "FIELD_FLAGS"]

FIELD_FLAGS = {"model.hidden_size": "--hidden", "model.num_attention_heads": "--heads", "num_attention_heads": "--heads",
               "model.num_query_groups": "--query-groups", "model.ffn_hidden_size": "--ffn",
               "model.vocab_size": "--vocab", "model.num_layers": "--layers", "model.seq_length": "--seq-len",
               "model.params_dtype": "--dtype", "model.recompute": "--recompute", "tp": "--tp", "rank": "--rank",
               "micro_batch": "--micro-batch", "seq_len": "--seq-len", "logprob_chunk_tokens": "--chunk-tokens",
               "masters": "--masters", "recompute": "--recompute"}
"""Config and planner fields the script's flags set, and those flags: what an unforeseen message is rewritten with."""

_ATTR = {"--hidden": "hidden", "--heads": "heads", "--query-groups": "query_groups", "--ffn": "ffn",
         "--vocab": "vocab", "--layers": "layers", "--rank": "rank"}
_DEFAULT_FROM = {"heads": "the default, --hidden // 64", "ffn": "the default, from --hidden"}

_HEAD_DIM = re.compile(r"^model\.hidden_size=(\d+) must be divisible by model\.num_attention_heads=(\d+)")
_GROUPS = re.compile(r"^model\.num_query_groups=(\d+) must divide num_attention_heads=(\d+)")
_TP = re.compile(r"^tp=(\d+) must divide model\.(num_attention_heads|num_query_groups|ffn_hidden_size)=(\d+): "
                 r"choose tp in (\[[\d, ]*\])")
_RANK = re.compile(r"^rank=(\d+) must be <= the smallest target input width (\d+) \((\w+)\)")
_MODEL = re.compile(r"^model=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")
_FIELD = re.compile(r"(?<![\w.-])(%s)=" % "|".join(sorted(map(re.escape, FIELD_FLAGS), key=len, reverse=True)))

_TP_WHAT = {"num_attention_heads": ("--heads", "attention heads"),
            "num_query_groups": ("--query-groups", "query groups (KV heads)"),
            "ffn_hidden_size": ("--ffn", "MLP width (ffn_hidden_size)")}
_RANK_WIDTH = {"linear_qkv": "--hidden", "linear_proj": "--hidden", "linear_fc1": "--hidden",
               "output_layer": "--hidden", "linear_fc2": "--ffn"}
"""The flag behind each LoGRA target's input width in a model the script sizes (no kv_channels: linear_proj reads
heads x head_dim = --hidden)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shown(flag: str, value: int | str, typed: Collection[str]) -> str:
    """``--heads=4``, with ``(the default, ...)`` when the script filled the value in rather than the user."""
    attr = _ATTR.get(flag)
    if attr is None or attr in typed:
        return f"{flag}={value}"
    return f"{flag}={value} ({_DEFAULT_FROM.get(attr, 'the default')})"


def _head_dim(hidden: int, heads: int, args: argparse.Namespace, typed: Collection[str]) -> str:
    groups = args.query_groups or 1
    fits = [d for d in _divisors(hidden) if d % groups == 0]
    near = sorted({max((d for d in fits if d <= heads), default=None), min((d for d in fits if d >= heads),
                                                                          default=None)} - {None})
    heads_fix = f"a --heads that divides {hidden} (e.g. {' or '.join(f'--heads={d}' for d in near)}) or " if near else ""
    multiple = -(-hidden // heads) * heads
    return (f"{_shown('--hidden', hidden, typed)} is not divisible by {_shown('--heads', heads, typed)}: each "
            f"attention head gets --hidden / --heads channels; give {heads_fix}a --hidden that is a multiple of "
            f"{heads} (e.g. --hidden={multiple})")


def _groups(groups: int, heads: int, typed: Collection[str]) -> str:
    return (f"--query-groups={groups} must divide {_shown('--heads', heads, typed)}: choose --query-groups in "
            f"{_divisors(heads)}, or give --heads a multiple of {groups}")


def _tp(m: re.Match, args: argparse.Namespace, typed: Collection[str]) -> str:
    tp, field, value, ok = int(m[1]), m[2], int(m[3]), m[4]
    flag, label = _TP_WHAT[field]
    if args.model:
        return f"--tp={tp} must divide the {value} {label} of --model {args.model}: choose --tp in {ok}"
    return f"--tp={tp} must divide {_shown(flag, value, typed)}: choose --tp in {ok}, or give {flag} a multiple of {tp}"


def _rank(m: re.Match, args: argparse.Namespace, typed: Collection[str]) -> str:
    rank, width, target = int(m[1]), int(m[2]), m[3]
    head = f"{_shown('--rank', rank, typed)} must be <= {width}, the input width of the LoGRA target {target}"
    if args.model:
        return f"{head} in --model {args.model}: give --rank <= {width}"
    flag = _RANK_WIDTH.get(target, "--hidden")
    return f"{head}, set by {_shown(flag, width, typed)}: give --rank <= {width} or a larger {flag}"


def _model(message: str, model: str) -> str:
    """A ``--model`` problem (unknown preset, missing or refused config.json) headed by the flag and its value."""
    m = _MODEL.match(message)
    if m:
        return f"--model {model}{message[m.end():]}"
    if message.startswith(model.strip()):  # a config.json's own problem names its path
        return f"--model {message}"
    return f"--model {model}: {message}"


def flag_error(message: str, args: argparse.Namespace, typed: Collection[str] = ()) -> str:
    """``message``, a ``ValueError`` raised while the script built its ``ModelConfig`` or planned its step, in the
    script's flags: layout and rank problems name ``--tp`` / ``--rank`` and the size flag (or ``--model``) they
    clash with, and the choices that work; model-shape problems name ``--hidden``, ``--heads``, ``--query-groups``;
    a ``--model`` that cannot be read is headed by ``--model VALUE``. ``typed`` holds the attributes the user gave
    (``hidden``, ``heads``, ..., ``rank``): any other value shown is marked as the script's default. A message of no
    known form has its field names replaced by the flags (``model.vocab_size=`` -> ``--vocab=``), or, under
    ``--model``, is headed by it."""
    m = _TP.match(message)
    if m:
        return _tp(m, args, typed)
    m = _RANK.match(message)
    if m:
        return _rank(m, args, typed)
    if args.model:
        return _model(message, args.model)
    m = _HEAD_DIM.match(message)
    if m:
        return _head_dim(int(m[1]), int(m[2]), args, typed)
    m = _GROUPS.match(message)
    if m:
        return _groups(int(m[1]), int(m[2]), typed)
    return _FIELD.sub(lambda f: f"{FIELD_FLAGS[f[1]]}=", message)

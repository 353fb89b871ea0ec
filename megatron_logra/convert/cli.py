"""``megatron-logra convert`` (also ``python tools/convert_checkpoint.py``)::

    megatron-logra convert hf-to-mcore --hf DIR --out DIR [--tp N] [--pp M] [--make-vocab-size-divisible-by K] [--force]
    megatron-logra convert mcore-to-hf --mcore DIR --out DIR [--hf-template DIR] [--max-shard-size 5GB]
                                       [--dtype bfloat16] [--no-verify] [--force]

``hf-to-mcore`` writes one ``model_tp{t}_pp{p}.safetensors`` per model-parallel rank (the parameter names
and TP shards of megatron-core's GPTModel as this trainer builds it at that TP / PP), ``meta.json`` and
``hf/``: for inspecting the megatron-side tensors, for your own megatron-core code
(``megatron_logra.convert.load_mcore_into_model`` loads them into a model of the same TP / PP) and for
``mcore-to-hf``. ``megatron-logra train`` does not read them: to train from a Hugging Face model give
the HF directory itself, ``megatron-logra train RECIPE --model.hf_path DIR`` (job=rl; its weights are
sharded on load to the run's TP / PP).
``mcore-to-hf`` also reads a trainer checkpoint step directory (``RUN/checkpoints/step_XXXXXXXX``), or
a run directory ``RUN`` for its latest checkpoint.
Prints the written ``meta.json`` (hf-to-mcore) or a summary (mcore-to-hf) as JSON; a rejected
input exits with status 2 and a message naming the field, tensor or file, and so does an output
that cannot be written (a full disk: the message names --out, the OS error and the file; --out is
left as it was).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_logra.cli import USER_ERRORS

__all__ = ["main", "build_parser"]

_DTYPE_NAMES = ("bfloat16", "float16", "float32")


def build_parser(prog: str = "megatron-logra convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser(
        "hf-to-mcore", help="Hugging Face safetensors -> per-rank megatron-core files (not read by train)",
        description="Write one model_tp{t}_pp{p}.safetensors per model-parallel rank (megatron-core GPTModel "
                    "parameter names and TP shards at --tp / --pp), meta.json and hf/ (the source config and "
                    "tokenizer). For inspecting the megatron-side tensors, for your own megatron-core code "
                    "(megatron_logra.convert.load_mcore_into_model loads them at the same TP / PP) and for "
                    "`convert mcore-to-hf`. `megatron-logra train` does not read them: start a run from the HF "
                    "directory itself with --model.hf_path DIR (job=rl), which shards the weights to the run's "
                    "TP / PP on load.")
    a.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output directory")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the output (default 1)")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the output (default 1)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="vocabulary padding multiple per TP rank (default: ModelConfig's, 16)")
    a.add_argument("--force", action="store_true",
                   help="replace an earlier hf-to-mcore output in --out (never a Hugging Face checkpoint)")
    b = sub.add_parser("mcore-to-hf", help="per-rank megatron-core files (or a trainer checkpoint) -> Hugging Face")
    b.add_argument("--mcore", required=True,
                   help="converted directory, trainer checkpoint step directory (RUN/checkpoints/step_XXXXXXXX) or run "
                        "directory RUN (its latest checkpoint)")
    b.add_argument("--out", required=True, help="output directory")
    b.add_argument("--hf-template", default=None,
                   help="HF directory whose config.json, tokenizer files and shard layout are reused (default for a "
                        "trainer checkpoint: the run's model.hf_path when present; the run's own tokenizer wins)")
    b.add_argument("--max-shard-size", default="5GB", help="shard size without a sharded template (default 5GB)")
    b.add_argument("--no-verify", action="store_true",
                   help="skip the checksum pass over --mcore: the sha256 of a converted directory's rank files, the "
                        "CRC-32 of every file of a trainer checkpoint (file sizes and meta.json are still checked)")
    b.add_argument("--dtype", choices=_DTYPE_NAMES, default=None,
                   help="write every tensor in this dtype, as save_pretrained of a model in it does (default: as "
                        "stored; a bf16 run keeps its norm weights in fp32 and config.json names bfloat16)")
    b.add_argument("--force", action="store_true",
                   help="replace an earlier mcore-to-hf output in --out (never another Hugging Face checkpoint)")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "megatron-logra convert") -> int:
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    for flag in ("hf", "mcore", "out"):  # "" would be the working directory (an unset $OUT)
        value = getattr(ns, flag, None)
        if value is not None and not value.strip():
            parser.error(f"--{flag.replace('_', '-')} is empty: give a directory (an empty value would stand for the "
                         "working directory)")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
    import torch

    from megatron_logra.convert.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_logra.convert.outdir import write_error_message

    try:
        if ns.direction == "hf-to-mcore":
            out = convert_hf_to_mcore(ns.hf, ns.out, tp=ns.tp, pp=ns.pp,
                                      make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by, force=ns.force)
        else:
            index = convert_mcore_to_hf(ns.mcore, ns.out, hf_template=ns.hf_template,
                                        max_shard_size=ns.max_shard_size, force=ns.force, verify=not ns.no_verify,
                                        dtype=getattr(torch, ns.dtype) if ns.dtype else None)
            out = {"out": ns.out, "mcore": index["mcore"], "files": index["files"], "metadata": index["metadata"],
                   "num_tensors": len(index["weight_map"])}
    except USER_ERRORS as exc:  # bad input (a path, a field, a tensor): one line, as the main CLI reports it
        if os.environ.get("MEGATRON_LOGRA_TRACEBACK", "") not in ("", "0"):
            raise
        sys.stderr.write(f"{prog} {ns.direction}: error: {exc}\n")
        return 2
    except OSError as exc:  # a full disk while writing --out: one line too; any other OSError is unexpected
        message = write_error_message(exc, Path(ns.out))
        if message is None or os.environ.get("MEGATRON_LOGRA_TRACEBACK", "") not in ("", "0"):
            raise
        sys.stderr.write(f"{prog} {ns.direction}: error: {message}\n")
        return 2
    sys.stdout.write(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

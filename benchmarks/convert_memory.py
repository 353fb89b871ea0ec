#!/usr/bin/env python
"""Checkpoint conversion memory: peak RSS growth and peak live tensor bytes of both directions.

``megatron_logra.convert`` streams: a conversion holds one full megatron parameter plus one part or
shard of it (at most 2x the largest parameter: the padded embedding or the fused ``[gate; up]``),
whatever the size of the checkpoint or of its shard files. ``tests/unit/test_convert.py`` checks this
exactly with the live tensor tracker. This benchmark measures the process memory as well.

For fp32 Llama checkpoints of a few sizes (HIDDENxLAYERS, ffn 3 x hidden, vocabulary 4000, 4 shard
files whose boundaries cut through layers), each direction runs in a fresh child process:
HF -> megatron-core at TP=2 PP=2, then back to HF in 40 MB shards. Measured per direction:

* **peak RSS growth**: ``VmHWM`` of ``/proc/self/status`` after the conversion, minus ``VmRSS`` after
  the peak was reset (``5 > /proc/self/clear_refs``). The children run with
  ``MALLOC_MMAP_THRESHOLD_=131072``: glibc's adaptive threshold would keep freed multi-MB blocks in
  the heap, and that allocator slack (up to about 2 more tensors) would blur what the converter
  holds. Linux only.
* **peak live tensors**: :class:`megatron_logra.memory.measure.LiveTensorTracker`, exact bytes of the
  tensor storages alive at the peak, above those alive before.

Both are shown next to the largest parameter and the whole checkpoint.

    python benchmarks/convert_memory.py [--sizes 256x12,512x12]

Results: a Markdown table on stdout (and in ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
VOCAB = 4000

_CHILD = r"""
import gc, json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[4])
from megatron_logra.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_logra.memory.measure import LiveTensorTracker

def status(key):  # kB fields of /proc/self/status
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")

direction, src, dst = sys.argv[1:4]
run = ((lambda: convert_hf_to_mcore(src, dst, tp=2, pp=2)) if direction == "to_mcore"
       else (lambda: convert_mcore_to_hf(src, dst, max_shard_size="40MB")))
if sys.argv[5] == "rss":
    gc.collect()
    base = reset_peak()
    run()
    print(json.dumps({"bytes": status("VmHWM") - base}))
else:
    gc.collect()
    with LiveTensorTracker() as tracker:
        run()
    print(json.dumps({"bytes": tracker.peak - tracker.start_bytes}))
"""


def write_checkpoint(src: Path, hidden: int, layers: int, num_files: int = 4) -> tuple[int, int]:
    """An fp32 Llama checkpoint in ``src``; returns (total bytes, bytes of the largest megatron parameter)."""
    import torch
    from safetensors.torch import save_file

    ffn = 3 * hidden
    raw = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, intermediate_size=ffn,
               num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB,
               tie_word_embeddings=False, dtype="float32", max_position_embeddings=128)
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(raw))
    kv = 2 * hidden // 8
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
    names = list(shapes)
    weight_map, total = {}, 0
    for k in range(num_files):
        chunk = names[k * len(names) // num_files:(k + 1) * len(names) // num_files]
        fname = f"model-{k + 1:05d}-of-{num_files:05d}.safetensors"
        state = {n: torch.full(shapes[n], float(j % 7)) for j, n in enumerate(chunk)}
        total += sum(t.numel() * 4 for t in state.values())
        save_file(state, str(src / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
        del state
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    from megatron_logra.convert import model_config_from_hf

    padded = model_config_from_hf(src).padded_vocab_size(2)
    return total, 4 * max(padded * hidden, 2 * ffn * hidden)


def _child(direction: str, src: Path, dst: Path, what: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, direction, str(src), str(dst), str(REPO), what],
                          capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{direction} ({what}) failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["bytes"]


def run_size(hidden: int, layers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="convert_memory_") as tmp:
        tmp = Path(tmp)
        total, largest = write_checkpoint(tmp / "hf_src", hidden, layers)
        row = {"size": f"{hidden}x{layers}", "checkpoint": total, "largest": largest}
        for what in ("rss", "live"):
            row[f"to_mcore_{what}"] = _child("to_mcore", tmp / "hf_src", tmp / f"mc_{what}", what)
            row[f"to_hf_{what}"] = _child("to_hf", tmp / f"mc_{what}", tmp / f"hf_{what}", what)
    return row


def _size(text: str) -> tuple[int, int]:
    try:
        hidden, layers = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give HIDDENxLAYERS, e.g. 512x12") from None
    if hidden < 8 or hidden % 8 or layers < 2 or layers % 2:
        raise argparse.ArgumentTypeError(f"{text!r}: hidden must be a multiple of 8 and layers even (PP=2)")
    return hidden, layers


def table(rows: list[dict]) -> str:
    lines = ["| size | checkpoint MiB | largest param MiB | hf->mcore RSS MiB | hf->mcore live MiB "
             "| mcore->hf RSS MiB | mcore->hf live MiB | bound 2x largest MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["size"]] + [f"{r[k] / MiB:.1f}" for k in ("checkpoint", "largest", "to_mcore_rss", "to_mcore_live",
                                                               "to_hf_rss", "to_hf_live")]
        lines.append("| " + " | ".join(cells) + f" | {2 * r['largest'] / MiB:.1f} |")
    return "\n".join(lines)


def prepare_out(parser: argparse.ArgumentParser, out: Path) -> None:
    """Make sure the Markdown file ``out`` can be written before anything runs: its directory is created
    when missing; a directory at ``out`` itself, or a parent that is not a writable directory, is a usage
    error (``parser.error``)."""
    if out.is_dir():
        parser.error(f"argument --out: {out} is a directory; give the path of a Markdown file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"argument --out: cannot create the directory of {out}: {exc.strerror or exc}")
    if not os.access(out.parent, os.W_OK):
        parser.error(f"argument --out: the directory {out.parent} is not writable")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256x12,512x12",
                        help="comma-separated HIDDENxLAYERS (ffn 3 x hidden, vocabulary 4000); default 256x12,512x12")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the table to this Markdown file (its directory is created first)")
    args = parser.parse_args(argv)
    if not Path("/proc/self/clear_refs").exists():
        parser.error("needs Linux /proc/self/clear_refs to reset the peak RSS")
    try:
        sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--sizes: {exc}")
    if args.out is not None:
        prepare_out(parser, args.out)
    rows = [run_size(h, n) for h, n in sizes]
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU smoke test of sketch-delta policy sync into a real SGLang engine.

    python tools/sglang_sync_smoke.py [--mode engine|http|both] [--hidden 1024 --layers 8 --rank 64 --deltas 3]

Builds a random Llama checkpoint with ``transformers`` (no download), starts SGLang on it with
``--custom-weight-loader megatron_logra.sync.sglang_loader.sync_loader`` (in-process
``sglang.Engine`` and/or a ``sglang.launch_server`` subprocess driven over HTTP), then:

1. greedy-generates from fixed prompts;
2. pushes ``--deltas`` sketch deltas (:mod:`megatron_logra.sync.synthetic`) through
   :class:`~megatron_logra.sync.sglang_client.SGLangEngineTarget` / ``SGLangServerTarget``, and
   applies the same deltas on CPU to the HF state (``layout="hf"``): the reference;
3. reads engine weights back with ``get_weights_by_name`` and compares them with the reference
   **bitwise** (at ``--tp`` > 1 only the replicated vectors: a split weight reads back as one
   rank's shard), and compares the engine's fingerprint (all tensors, sampled rows, assembled
   across the engine's TP ranks) with the reference's sampled with the engine's salt, which must
   be the engine's weight version;
4. greedy-generates again, then full-refits the reference weights through SGLang's default
   loader and generates once more: the two generations must be identical (same weights, same
   kernels), and must differ from step 1 only if the weights moved generation;
5. checks that a replayed delta is refused and leaves the version alone.

Prints bytes per sync, apply time against full-refit time, and PASS/FAIL (exit status 0/1; 3 when
it cannot run here: no CUDA device, or SGLang not installed).
About 1-3 minutes per mode on one GPU, most of it SGLang start-up. ``tests/gpu/test_sglang_sync.py``
runs :func:`check` on a tiny model.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_logra.argtypes import key_json, positive_int
from megatron_logra.sync import SyncError, encode
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.fingerprint import drift, fingerprint, fingerprint_salt
from megatron_logra.sync.sglang_client import SGLangEngineTarget, SGLangServerTarget
from megatron_logra.sync.sglang_loader import LOADER_PATH
from megatron_logra.sync.synthetic import DenseShape, random_delta

CANNOT_RUN = 3
"""Exit status when the smoke test cannot run here (no CUDA device, SGLang not installed): nothing was checked."""
TINY = DenseShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512)
PROMPTS = [[1, 15, 27, 300, 42, 7, 99], [5, 6, 7, 8], [200, 201, 3]]


def log(msg: str) -> None:
    print(f"[sglang-sync] {msg}", flush=True)


# --------------------------------------------------------------------------- model and deltas


def build_checkpoint(path: Path, shape: DenseShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random bf16 Llama saved with ``save_pretrained`` to ``path``; returns its HF state (CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.d,
                      vocab_size=shape.vocab, max_position_embeddings=1024, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # norms away from 1 so dense updates of them are visible
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
    model.save_pretrained(path, safe_serialization=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if set(state) != set(shape.hf_shapes()):
        raise RuntimeError(f"HF names differ from DenseShape: {sorted(set(state) ^ set(shape.hf_shapes()))[:6]}")
    return state


def make_deltas(shape: DenseShape, n: int, rank: int, *, seed: int = 7, scale: float = 2e-3) -> list:
    """``n`` chained deltas 0->1->...->n; the first also carries a dense ``model.norm.weight``."""
    out = []
    for v in range(n):
        dense = {"model.norm.weight": torch.linspace(0.5, 1.5, shape.hidden)} if v == 0 else {}
        out.append(random_delta(shape, rank, base_version=v, new_version=v + 1, seed=seed, update_index=v,
                                generator_seed=100 + v, scale=scale, dense=dense))
    return out


def reference(state: dict[str, torch.Tensor], deltas: list) -> dict[str, torch.Tensor]:
    ref = {k: v.clone() for k, v in state.items()}
    for d in deltas:
        apply_delta_(ref, d, d.base_version, layout="hf")
    return ref


# --------------------------------------------------------------------------- drivers


def engine_kwargs(model_path: str, extra: Optional[dict] = None) -> dict:
    kw = dict(model_path=model_path, dtype="bfloat16", tp_size=1, mem_fraction_static=0.2, disable_cuda_graph=True,
              disable_radix_cache=True, skip_tokenizer_init=True, random_seed=0, context_length=1024,
              custom_weight_loader=[LOADER_PATH], log_level="error")
    kw.update(extra or {})
    return kw


class EngineDriver:
    """In-process ``sglang.Engine``."""

    name = "engine"

    def __init__(self, model_path: str, extra: Optional[dict] = None) -> None:
        import sglang

        self.engine = sglang.Engine(**engine_kwargs(model_path, extra))
        self.target = SGLangEngineTarget(self.engine)

    def generate(self, prompts, n_tokens: int) -> list[list[int]]:
        outs = self.engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": n_tokens,
                                                                        "ignore_eos": True})
        return [list(o["output_ids"]) for o in outs]

    def read(self, name: str) -> Optional[torch.Tensor]:
        values = self.engine.get_weights_by_name(name, truncate_size=1 << 31)
        return None if values is None else torch.tensor(values, dtype=torch.float32)

    def close(self) -> None:
        self.engine.shutdown()


class ServerDriver:
    """``python -m sglang.launch_server`` in a subprocess, driven over HTTP (API key on)."""

    name = "http"

    def __init__(self, model_path: str, extra: Optional[dict] = None, serialization: str = "pickle",
                 startup_s: float = 400.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        key = "smoke-key"
        kw = engine_kwargs(model_path, extra)
        kw.pop("log_level")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
               "--api-key", key]
        for k, v in kw.items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                cmd.append(flag)
            elif isinstance(v, list):
                cmd += [flag, *map(str, v)]
            elif v is not False and v is not None:
                cmd += [flag, str(v)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.target = SGLangServerTarget(f"http://127.0.0.1:{port}", api_key=key, timeout=300,
                                         serialization=serialization)
        deadline = time.time() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang server exited ({self.proc.returncode}); log {self.log.name}:\n"
                                   + Path(self.log.name).read_text()[-3000:])
            try:
                if self.target.request("GET", "/health", ok_status=(503,))[0] == 200:
                    break
            except SyncError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"sglang server not healthy after {startup_s:.0f}s; log {self.log.name}")
            time.sleep(2)

    def generate(self, prompts, n_tokens: int) -> list[list[int]]:
        params = {"temperature": 0.0, "max_new_tokens": n_tokens, "ignore_eos": True}
        _, outs = self.target.request("POST", "/generate", {"input_ids": prompts, "sampling_params": params})
        return [list(o["output_ids"]) for o in outs]

    def read(self, name: str) -> Optional[torch.Tensor]:
        status, values = self.target.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": 1 << 31},
                                             ok_status=(400,))
        return torch.tensor(values, dtype=torch.float32) if status == 200 else None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- the check


def check(driver: Any, state: dict[str, torch.Tensor], deltas: list, *, readback: Optional[Callable] = None,
          n_tokens: int = 16, report: Callable[[str], None] = log) -> dict:
    """Run steps 1-5 of the module docstring on ``driver``; returns a dict with ``passed`` and the numbers."""
    target = driver.target
    failures: list[str] = []
    res: dict[str, Any] = {"mode": driver.name}
    readback = readback or (lambda name: True)
    assert target.weight_version == 0, f"fresh engine at version {target.weight_version}"
    tokens_before = driver.generate(PROMPTS, n_tokens)

    sizes, times = [], []
    for d in deltas:
        data = encode(d)
        t0 = time.perf_counter()
        version = target.apply_sketch_delta(data)
        times.append(time.perf_counter() - t0)
        sizes.append(len(data))
        if version != d.new_version:
            failures.append(f"apply returned version {version}, expected {d.new_version}")
    ref = reference(state, deltas)

    names = [n for n in sorted(ref) if readback(n)]
    mismatched = []
    for name in names:
        got = driver.read(name)
        if got is None or got.shape != ref[name].shape or not torch.equal(got, ref[name].float()):
            mismatched.append(name)
    moved = [n for n in names if not torch.equal(ref[n], state[n])]
    if mismatched:
        failures.append(f"{len(mismatched)}/{len(names)} engine weights differ from the CPU reference, "
                        f"e.g. {mismatched[:3]}")
    if not moved and any(ref[n].dim() == 2 for n in names):  # TP > 1 reads back replicated vectors only
        failures.append("the deltas did not change any weight read back")
    fp = target.fingerprint()
    salt = fingerprint_salt(fp)  # the reference samples the rows the engine sampled
    fp_drift = None if fp is None else drift(fp, fingerprint(ref, salt=salt))
    if fp is None:
        failures.append("the engine could not fingerprint its weights (see the sync_loader state)")
    else:
        if salt != target.weight_version:
            failures.append(f"the engine's fingerprint samples the rows of salt {salt}, not of its weight version "
                            f"{target.weight_version}")
        if fp_drift:
            failures.append(f"fingerprint drift in {len(fp_drift)} tensors, e.g. {fp_drift[:3]}")

    tokens_delta = driver.generate(PROMPTS, n_tokens)
    full_bytes = sum(t.numel() * t.element_size() for t in ref.values())
    t0 = time.perf_counter()
    target.update_weights_full(ref, len(deltas) + 100)
    full_s = time.perf_counter() - t0
    tokens_full = driver.generate(PROMPTS, n_tokens)
    if tokens_full != tokens_delta:
        failures.append(f"greedy tokens after deltas {tokens_delta} != after a full refit of the reference "
                        f"{tokens_full}")
    if target.weight_version != len(deltas) + 100:
        failures.append(f"version after the refit is {target.weight_version}")
    try:
        target.apply_sketch_delta(encode(deltas[-1]))
        failures.append("a replayed delta was accepted")
    except SyncError as exc:
        if target.weight_version != len(deltas) + 100:
            failures.append(f"a refused replay moved the version to {target.weight_version} ({exc})")

    res.update(
        passed=not failures, failures=failures, bytes_per_sync=statistics.mean(sizes), full_refit_bytes=full_bytes,
        apply_s=statistics.median(times), apply_s_all=times, full_refit_s=full_s, weights_checked=len(names),
        weights_moved=len(moved), fingerprint_checked=fp is not None, fingerprint_salt=salt,
        generation_changed=tokens_before != tokens_delta, tokens_after_deltas=tokens_delta)
    report(f"{driver.name}: {len(deltas)} deltas, {res['bytes_per_sync'] / 2**20:.2f} MiB/sync "
           f"({100 * res['bytes_per_sync'] / full_bytes:.1f}% of a {full_bytes / 2**20:.1f} MiB bf16 refit); "
           f"apply {1e3 * res['apply_s']:.0f} ms (median) vs full refit {1e3 * full_s:.0f} ms; "
           f"{len(names)} weights compared bitwise ({len(moved)} moved); fingerprint "
           f"{'ok' if fp is not None and not fp_drift else 'skipped' if fp is None else 'DRIFT'}; "
           f"generation changed by the deltas: {res['generation_changed']}")
    for f in failures:
        report(f"FAIL {driver.name}: {f}")
    return res


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Exit status: 0 every check passed, 1 a check failed, 2 a bad argument, {CANNOT_RUN} nothing could "
               "run here (no CUDA device, or SGLang not installed).")
    p.add_argument("--mode", choices=("engine", "http", "both"), default="both",
                   help="in-process sglang.Engine, a launch_server subprocess over HTTP, or both (default)")
    for flag, default, what in (("--hidden", 1024, "hidden size"), ("--layers", 8, "layers"),
                                ("--heads", 16, "attention heads"), ("--kv-heads", 4, "key/value heads"),
                                ("--ffn", 2816, "MLP width"), ("--vocab", 8192, "vocabulary"),
                                ("--rank", 64, "sketch rank of the deltas"), ("--deltas", 3, "deltas pushed"),
                                ("--tokens", 16, "greedy tokens per prompt")):
        p.add_argument(flag, type=positive_int, default=default, help=f"{what} (default {default})")
    p.add_argument("--serialization", choices=("pickle", "cuda_ipc"), default="pickle", help="HTTP mode payloads")
    p.add_argument("--engine-arg", type=key_json, action="append", default=[], metavar="KEY=JSON",
                   help="extra sglang ServerArgs, e.g. attention_backend='\"triton\"'")
    p.add_argument("--tp", type=positive_int, default=1, help="SGLang tensor-parallel size (GPUs); > 1 compares the "
                   "sharded weights through fingerprints and generation, reading back only replicated vectors")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads or args.hidden % args.heads:
        p.error(f"argument --kv-heads: --hidden {args.hidden}, --heads {args.heads} and --kv-heads {args.kv_heads} "
                "must divide: hidden by heads, heads by kv-heads")
    if args.rank > min(args.hidden, args.ffn):
        p.error(f"argument --rank: {args.rank} is above the narrowest target input ({min(args.hidden, args.ffn)})")
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        p.error(f"argument --json: {args.json} is a directory or its directory does not exist")
    try:
        importlib.import_module("sglang")
    except ImportError:
        print(f"{p.prog}: SGLang is not installed (pip install 'megatron-logra[sglang]'): nothing was checked",
              file=sys.stderr)
        return CANNOT_RUN
    if not torch.cuda.is_available():
        print(f"{p.prog}: no CUDA device (SGLang runs on the GPU): nothing was checked", file=sys.stderr)
        return CANNOT_RUN
    extra = dict(args.engine_arg)
    extra.setdefault("tp_size", args.tp)
    shape = DenseShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                       ffn=args.ffn, vocab=args.vocab)
    results = []
    with tempfile.TemporaryDirectory(prefix="logra-sglang-") as tmp:
        state = build_checkpoint(Path(tmp) / "ckpt", shape)
        deltas = make_deltas(shape, args.deltas, args.rank)
        big = 4 * 2**20  # read back tensors up to 4M elements (and the first/last layer always)
        last = f"model.layers.{shape.layers - 1}."

        def readback(name: str) -> bool:
            if extra["tp_size"] > 1:  # get_weights_by_name returns one rank's shard of a split weight
                return state[name].dim() == 1
            return state[name].numel() <= big and (name.startswith(("model.layers.0.", last)) or state[name].dim() == 1
                                                  or shape.layers <= 2)

        for mode in (("engine", "http") if args.mode == "both" else (args.mode,)):
            t0 = time.perf_counter()
            driver = (EngineDriver if mode == "engine" else ServerDriver)(
                str(Path(tmp) / "ckpt"), extra, **({"serialization": args.serialization} if mode == "http" else {}))
            log(f"{mode}: SGLang up in {time.perf_counter() - t0:.0f}s")
            try:
                results.append(check(driver, state, deltas, readback=readback, n_tokens=args.tokens))
            finally:
                driver.close()
    ok = all(r["passed"] for r in results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    log("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

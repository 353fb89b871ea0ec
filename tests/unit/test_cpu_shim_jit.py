"""With no CUDA device, importing ``megatron_logra`` first makes megatron-core's ``jit_fuser`` a no-op, so
megatron-core's import decorates nothing with ``torch.compile`` and TorchDynamo / Inductor stay unimported.

Each case runs in a fresh interpreter (this process has imported megatron-core long ago), with
``CUDA_VISIBLE_DEVICES=""`` so a CUDA machine takes the CPU path too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
{first}
import torch
import megatron.core.jit as jit
from megatron.core.transformer.utils import gelu_impl
from megatron.core.models.gpt import GPTModel  # the modules this project builds from
x = torch.linspace(-4, 4, 101, dtype=torch.float64)
ref = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
print(json.dumps({{
    "fuser_is_compile": jit.jit_fuser is torch.compile,
    "dynamo": "torch._dynamo" in sys.modules,
    "inductor": "torch._inductor" in sys.modules,
    "torch_before": {torch_before},
    "gelu_max_err": float((gelu_impl(x) - ref).abs().max()),
    "default_is_compile": (jit.enable_jit_fuser(), jit.jit_fuser is torch.compile)[1],
}}))
"""


def _probe(first: str, torch_before: str = "None") -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    code = _PROBE.format(first=first, torch_before=torch_before)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_megatron_imported_after_the_package_compiles_nothing_and_computes_the_same():
    got = _probe("import megatron_logra\ntorch_imported = 'torch' in sys.modules",
                 torch_before="torch_imported")
    assert got["torch_before"] is False, "importing megatron_logra must not import torch"
    assert got["default_is_compile"] is True  # megatron-core's own choice here, which the hook undid
    assert got["fuser_is_compile"] is False
    assert got["dynamo"] is False and got["inductor"] is False
    assert got["gelu_max_err"] == 0.0  # the undecorated function is the same formula, run eagerly

"""The CPU shim must not change what plain torch / transformers code computes."""

import subprocess
import sys

import torch
import pytest

SCRIPT = r"""
import tempfile, torch
from megatron_logra import cpu_shim
assert cpu_shim.activate()
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, max_position_embeddings=32)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)
path = tempfile.mkdtemp()
model.save_pretrained(path)
loaded = LlamaForCausalLM.from_pretrained(path)   # builds under `with torch.device(...)`
x = torch.arange(10)[None]
with torch.no_grad():
    print(float((model(x).logits - loaded(x).logits).abs().max()))
with torch.device("meta"):
    print(torch.empty(3).device, torch.zeros(2, 2).device)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is only active without CUDA")
def test_from_pretrained_and_meta_device_work_with_the_shim_active():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    diff, devices = out.stdout.strip().splitlines()[-2:]
    assert float(diff) == 0.0  # rotary inv_freq and every weight loaded exactly
    assert devices == "meta meta"

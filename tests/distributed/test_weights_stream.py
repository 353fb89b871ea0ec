"""Streamed full weights and row-sampled trainer fingerprints at TP 2 and TP 2 x PP 2 (gloo, CPU).

The dense refit streams one full parameter at a time and the drift check gathers only the rows
it hashes (``rl.weights``), so neither holds the whole model. Both must agree bit for bit with
whole-model references, on every rank, and the fingerprint must catch a change made on a single
TP rank of a single stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "weights_stream_worker.py"


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_streamed_weights_and_sampled_fingerprint_match_whole_model(launcher, tmp_path, tp, pp):
    launcher.launch(tp * pp, [str(WORKER), str(tmp_path), str(tp), str(pp)], timeout=300,
                    log=tmp_path / "launch.log")
    results = json.loads((tmp_path / "result.json").read_text())
    assert len(results) == tp * pp
    for r in results:
        assert r["stream_sorted_unique"] and r["stream_names_equal"] and r["stream_bitwise"], r
        # bf16 weights stream as bf16; megatron keeps the norms in fp32
        assert r["stream_dtypes"] == ["torch.bfloat16", "torch.float32"], r
        assert r["fp_bf16_drift"] == [] and r["fp_native_drift"] == [], r
        assert r["num_hf_tensors"] == 4 * 12 + 3  # per layer q,k,v (+3 biases), o, gate, up, down, 2 norms
        assert r["engine_version"] == 3 and r["engine_salt"] == 3 and r["engine_drift"] == [], r
        layer = r["perturbed_layer"]
        assert layer is not None
        pre = f"model.layers.{layer}."
        assert r["perturbed_drift"] == sorted([pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight",
                                               pre + "self_attn.o_proj.weight"]), r

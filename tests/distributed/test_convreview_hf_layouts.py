"""A Hugging Face checkpoint at TP=2 and at PP=2 (two gloo ranks): loaded into the megatron model, its logits
equal transformers' on the same tokens; the model's trainer checkpoint, exported back to Hugging Face, holds
exactly the original tensors and computes the same logits in transformers; ``hf-to-mcore`` at that layout
writes exactly the shards the loaded model holds.

Models: Qwen2 (QKV biases, GQA 4/2, tied embeddings: at PP=2 the last stage holds megatron's copy of the
embeddings as its output layer) and Llama (GQA 8/2, head_dim 12 ≠ hidden / heads, untied). fp32; vocabulary 70,
padded to 80 at TP=1 and 96 at TP=2, so the padded rows are where the exported vocabulary is cut.
Tolerance as in ``tests/unit/test_convert.py``: ``|Δlogit| <= 1e-5 · max|logit|``.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().parent / "convreview_layout_worker.py"
TOKENIZER = Path(__file__).resolve().parents[2] / "megatron_logra" / "assets" / "warm_start_tiny" / "tokenizer"
V = 70
REL_TOL = 1e-5
CASES = {
    "qwen2_bias_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_wide_untied": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                                              tie_word_embeddings=False)),
}


def _hf_model(root: Path, case: str):
    import transformers
    from transformers import AutoModelForCausalLM

    name, kw = CASES[case]
    config = getattr(transformers, name)(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=None,
                                         eos_token_id=None, pad_token_id=None, **kw)
    config.architectures = [name.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # O(1) logits; perturbed norms and biases catch misplaced 1-D tensors
        for _, p in model.named_parameters():
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))
    out = root / case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    for f in TOKENIZER.iterdir():
        shutil.copyfile(f, out / f.name)
    return out, model


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_hf_checkpoint_at_tp2_and_pp2(case, tp, pp, launcher, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir, hf = _hf_model(tmp_path, case)
    work = tmp_path / "work"
    work.mkdir()
    tokens = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, work / "tokens.pt")
    launcher.launch(2, [str(WORKER), str(hf_dir), str(tp), str(pp), str(work)], timeout=300,
                    log=tmp_path / "launch.log")

    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
    logits = torch.load(work / "logits.pt")
    padded = 96 if tp == 2 else 80
    assert logits.shape == (2, 13, padded)
    scale, err = ref.abs().max().item(), (logits[..., :V] - ref).abs().max().item()
    assert scale > 0.5
    assert err <= REL_TOL * scale, f"{case} tp={tp} pp={pp}: max |Δlogit| {err:.3g} > {REL_TOL} × {scale:.3g}"

    # the export of the trainer checkpoint: the original tensors, bitwise, and transformers' logits
    original = load_file(str(hf_dir / "model.safetensors"))
    exported = {}
    for f in sorted((work / "export").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    assert set(exported) == set(original) - ({"lm_head.weight"} if CASES[case][1]["tie_word_embeddings"] else set())
    for name, tensor in exported.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = AutoModelForCausalLM.from_pretrained(work / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, ref)

    # hf-to-mcore at this layout: the shards the loaded model holds, rank by rank
    for t in range(tp):
        for p in range(pp):
            shards = torch.load(work / f"shard_tp{t}_pp{p}.pt")
            written = load_file(str(work / "mc" / f"model_tp{t}_pp{p}.safetensors"))
            assert set(written) == set(shards), (t, p)
            for name, tensor in shards.items():
                assert torch.equal(written[name], tensor), (t, p, name)

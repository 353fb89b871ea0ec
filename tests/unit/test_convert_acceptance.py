"""``megatron-logra convert`` as a user runs it: export a training run by its directory, and bad input
that ends in one ``error:`` line naming the problem and the fix, exit status 2, and no output.

* ``mcore-to-hf --mcore RUN`` (also ``RUN/checkpoints`` and ``RUN/checkpoints/latest``) exports the
  run's latest checkpoint, bit for bit what naming the step directory exports, and the exported model's
  logits equal the trainer model's (fp32; ``test_convert.REL_TOL``). It used to be refused with "no
  meta.json" although the run had a checkpoint.
* A run directory without a complete checkpoint, a path that does not exist and a Hugging Face directory
  given as ``--mcore`` are each named as such.
* A ``--tp`` that does not divide ``num_key_value_heads`` (MQA) names the Hugging Face field and a TP size
  that fits; shards without their ``model.safetensors.index.json`` are named; a ``--hf-template`` of
  another model names ``--hf-template``.
"""

from __future__ import annotations

# test_convert resolves transformers' lazy model modules and torch's device-constructor cache before
# megatron_logra's CPU shim is imported (see there): keep this import first.
from test_convert import REL_TOL, TOKENIZER, _logits, _megatron  # noqa: I001

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from megatron_logra.checkpoint import save_checkpoint
from megatron_logra.convert.cli import main
from megatron_logra.data.tokenizer import load_tokenizer, save_tokenizer
from megatron_logra.models.gpt import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

V = 70
CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                  vocab_size=V, seq_length=32, qk_layernorm=True, untie_embeddings_and_output_weights=False,
                  params_dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module runs single-threaded (conftest.one_thread)."""


def _convert(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _refused(argv: list[str], capsys, direction: str, *needles: str) -> str:
    """``argv`` ends with exit status 2 and one line naming every needle; --out is not created."""
    code, _, err = _convert(argv, capsys)
    assert code == 2, err
    assert err.startswith(f"megatron-logra convert {direction}: error:"), err
    assert "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    out = Path(argv[argv.index("--out") + 1])
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*")), "an output (or its build dir) was left"
    return err


@pytest.fixture(scope="module")
def run(groups, tmp_path_factory):
    """A run directory as the RL job leaves it: config.yaml, tokenizer/ and two checkpoints (``latest`` names
    the second), with O(1) logits; returns (RUN, the model of the latest checkpoint)."""
    root = tmp_path_factory.mktemp("run") / "run"
    root.mkdir()
    (root / "config.yaml").write_text("job: rl\n")
    save_tokenizer(load_tokenizer(TOKENIZER), root / "tokenizer")
    model = _megatron(CFG, groups)
    gen = torch.Generator().manual_seed(5)
    for step in (2, 4):
        with torch.no_grad():
            for _, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                p.copy_((1 + 0.3 * noise) if p.dim() == 1 else 0.15 * noise)
        save_checkpoint(root, step, model, None, groups, config={"model": dataclasses.asdict(CFG)})
    assert (root / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    return root, model


@pytest.mark.parametrize("form", ["RUN", "RUN/checkpoints", "RUN/checkpoints/latest"])
def test_mcore_to_hf_exports_the_latest_checkpoint_of_a_run_directory(form, run, tmp_path, capsys):
    root, model = run
    mcore = {"RUN": root, "RUN/checkpoints": root / "checkpoints",
             "RUN/checkpoints/latest": root / "checkpoints" / "latest"}[form]
    code, out, err = _convert(["mcore-to-hf", "--mcore", str(mcore), "--out", str(tmp_path / "hf")], capsys)
    assert code == 0, err
    step = root / "checkpoints" / "step_00000004"
    assert json.loads(out)["mcore"] == str(step)
    assert _convert(["mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "by_step")], capsys)[0] == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    by_step = load_file(str(tmp_path / "by_step" / "model.safetensors"))
    assert set(exported) == set(by_step) and all(torch.equal(exported[k], by_step[k]) for k in exported)
    if form != "RUN":
        return
    # the exported model loads in transformers, computes the trainer model's logits, and the run's tokenizer loads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert isinstance(hf.config, Qwen3Config)
    tokens = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(3))
    ref = _logits(model.eval(), tokens)[..., :V]
    with torch.no_grad():
        got = hf.eval()(input_ids=tokens).logits
    scale, diff = ref.abs().max().item(), (got - ref).abs().max().item()
    assert scale > 0.5 and diff <= REL_TOL * scale, (diff, scale)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tok.get_vocab() == load_tokenizer(TOKENIZER).get_vocab()


def test_a_run_directory_without_a_checkpoint_is_refused_naming_it(tmp_path, capsys):
    root = tmp_path / "run"
    (root / "checkpoints").mkdir(parents=True)
    (root / "config.yaml").write_text("job: rl\n")
    out = str(tmp_path / "hf")
    for mcore in (root, root / "checkpoints"):
        _refused(["mcore-to-hf", "--mcore", str(mcore), "--out", out], capsys, "mcore-to-hf",
                 f"the run {root} has no complete checkpoint", "checkpoints/latest is missing",
                 "train.save_interval")
    (root / "checkpoints").rmdir()  # a run stopped before anything was saved
    _refused(["mcore-to-hf", "--mcore", str(root), "--out", out], capsys, "mcore-to-hf",
             "run directory without checkpoints/", "saved no checkpoint")


def test_a_missing_or_hugging_face_mcore_directory_is_named(tmp_path, capsys):
    out = str(tmp_path / "hf")
    _refused(["mcore-to-hf", "--mcore", str(tmp_path / "nothing"), "--out", out], capsys, "mcore-to-hf",
             "does not exist", "RUN/checkpoints/step_XXXXXXXX")
    hf = tmp_path / "an_hf_model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    _refused(["mcore-to-hf", "--mcore", str(hf), "--out", out], capsys, "mcore-to-hf",
             "is a Hugging Face checkpoint", "hf-to-mcore --hf")


@pytest.fixture(scope="module")
def mqa_sharded(tmp_path_factory):
    """A Qwen3 checkpoint with one KV head (MQA), saved in three shards with their index."""
    config = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = ["Qwen3ForCausalLM"]
    out = tmp_path_factory.mktemp("hf") / "mqa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, max_shard_size="40KB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    return out


def test_a_tp_that_does_not_divide_the_kv_heads_names_the_hf_field_and_a_tp_that_fits(mqa_sharded, tmp_path,
                                                                                        capsys):
    _refused(["hf-to-mcore", "--hf", str(mqa_sharded), "--out", str(tmp_path / "mc"), "--tp", "2"], capsys,
             "hf-to-mcore", "model.num_query_groups=1 is not divisible by tp=2", "num_key_value_heads", "tp=1")
    _refused(["hf-to-mcore", "--hf", str(mqa_sharded), "--out", str(tmp_path / "mc"), "--pp", "4"], capsys,
             "hf-to-mcore", "num_hidden_layers", "pp=2")


def test_shards_without_their_index_are_named(mqa_sharded, tmp_path, capsys):
    hf = tmp_path / "no_index"
    hf.mkdir()
    for f in mqa_sharded.iterdir():
        if f.name != "model.safetensors.index.json":
            (hf / f.name).write_bytes(f.read_bytes())
    _refused(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys, "hf-to-mcore",
             "model-00001-of-", "no model.safetensors.index.json naming which tensor is in which file")


def test_a_template_of_another_model_names_hf_template(mqa_sharded, run, tmp_path, capsys):
    root, _ = run
    _refused(["mcore-to-hf", "--mcore", str(root), "--out", str(tmp_path / "hf"), "--hf-template", str(mqa_sharded)],
             capsys, "mcore-to-hf", f"--hf-template {mqa_sharded} is not a template of this checkpoint",
             "model.num_query_groups=2", "leave --hf-template out")

"""``--model.hf_path DIR`` takes the tokenizer from the checkpoint, as it takes the architecture and weights:
a ``tokenizer.path`` that a named recipe sets (``tiny``'s shipped word tokenizer) yields to it, while one the
user gives (an override or a recipe file's field) stays, and so does a resumed run's saved one. A tokenizer
with more tokens than the model has embedding rows is refused when the job starts, naming where the
tokenizer came from and ``model.vocab_size``.

The checkpoint here is a two-layer Llama written by ``transformers`` with its own character tokenizer of
300 tokens (built with the ``tokenizers`` library), which encodes text differently from ``tiny``'s 146-token
word tokenizer."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_logra.cli import main
from megatron_logra.config import to_dict, apply_overrides, load_recipe, parse_args_to_config
from support.run_fixtures import tiny_llama_dir

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

VOCAB = 300


def _char_tokenizer(directory: Path):
    """A character tokenizer of exactly :data:`VOCAB` tokens saved with ``save_pretrained`` into ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for c in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    while len(vocab) < VOCAB:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(str(directory))
    assert len(tok) == VOCAB
    return tok


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A real HF checkpoint (config, safetensors weights) with its own tokenizer of :data:`VOCAB` tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("hf_llama") / "hf"
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    _char_tokenizer(out)
    return out


RECIPE_TOKENIZER = load_recipe("tiny").tokenizer.path


def test_the_tiny_recipe_sets_its_own_tokenizer():
    assert RECIPE_TOKENIZER and Path(RECIPE_TOKENIZER, "tokenizer.json").exists()  # what the checkpoint must replace


def test_a_named_recipes_tokenizer_yields_to_model_hf_path(tmp_path, capsys):
    hf = tiny_llama_dir(tmp_path, tokenizer=True)  # config loads the checkpoint's tokenizer, as train does
    assert parse_args_to_config("tiny", [f"model.hf_path={hf}"]).tokenizer.path == ""
    assert main(["config", "tiny", "--model.hf_path", str(hf), "model.seq_length=96"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["tokenizer"]["path"] == ""
    base = tmp_path / "base.yaml"  # a recipe file on top of tiny that does not name a tokenizer
    base.write_text(f"recipe: tiny\nmodel:\n  hf_path: {hf}\n")
    assert parse_args_to_config(str(base), []).tokenizer.path == ""
    assert load_recipe(str(base)).tokenizer.path == ""
    assert parse_args_to_config("tiny", []).tokenizer.path == RECIPE_TOKENIZER  # without hf_path: unchanged


def test_a_tokenizer_the_user_gives_stays_with_model_hf_path(tmp_path):
    hf = tiny_llama_dir(tmp_path)
    given = parse_args_to_config("tiny", [f"model.hf_path={hf}", f"tokenizer.path={RECIPE_TOKENIZER}"])
    assert given.tokenizer.path == RECIPE_TOKENIZER
    flag = parse_args_to_config("tiny", [f"--tokenizer.path={RECIPE_TOKENIZER}", "--model.hf_path", str(hf)])
    assert flag.tokenizer.path == RECIPE_TOKENIZER
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"recipe: tiny\nmodel:\n  hf_path: {hf}\ntokenizer:\n  path: {RECIPE_TOKENIZER}\n")
    assert parse_args_to_config(str(mine), []).tokenizer.path == RECIPE_TOKENIZER
    # a resumed run's saved config (its tokenizer.path was the user's choice) is not touched
    from megatron_logra.config import RunConfig, from_dict

    saved = from_dict(RunConfig, json.loads(json.dumps(to_dict(given))))
    assert apply_overrides(saved, ["rl.steps=7"]).tokenizer.path == RECIPE_TOKENIZER


def _build(cfg):
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.components import build_components

    destroy_parallel()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            comps, _, _ = build_components(cfg)
        return comps
    finally:
        destroy_parallel()


def test_the_rl_job_from_model_hf_path_uses_the_checkpoints_tokenizer(hf_llama, tmp_path, one_thread):
    from megatron_logra.data.tokenizer import load_tokenizer

    run = tmp_path / "run"
    cfg = parse_args_to_config("tiny", [f"model.hf_path={hf_llama}", "model.seq_length=96", f"train.run_dir={run}",
                                        "train.progress=false", "rl.prompts_per_step=2", "rl.group_size=4",
                                        "task.num_eval=4"])
    comps = _build(cfg)
    theirs = load_tokenizer(hf_llama)
    text = "State the final answer to the following arithmetic problem: 3 + 4 ="
    expected = [3 + ord(c) - 32 for c in text]  # the checkpoint's character ids (3 specials, then ASCII from " ")
    assert theirs(text)["input_ids"] == expected
    for tok in (comps.tokenizer, load_tokenizer(run / "tokenizer")):  # the job's and what eval / export reuse
        assert len(tok) == VOCAB and tok(text)["input_ids"] == expected
    assert comps.stop_token_ids() == [1]  # the checkpoint's </s>


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_at_start(tmp_path, one_thread):
    hf = tiny_llama_dir(tmp_path)  # config.json only: vocab_size 160; refused before any weight is read
    big = tmp_path / "big"
    _char_tokenizer(big)
    cfg = parse_args_to_config("tiny", [f"model.hf_path={hf}", f"tokenizer.path={big}", "model.seq_length=96",
                                        f"train.run_dir={tmp_path / 'run1'}", "train.progress=false"])
    with pytest.raises(ValueError, match=rf"tokenizer\.path='{big}' has {VOCAB} tokens but model\.vocab_size=160"):
        _build(cfg)
    _char_tokenizer(hf)  # the checkpoint's own tokenizer does not fit its model
    cfg = parse_args_to_config("tiny", [f"model.hf_path={hf}", "model.seq_length=96",
                                        f"train.run_dir={tmp_path / 'run2'}", "train.progress=false"])
    with pytest.raises(ValueError, match=rf"model\.hf_path='{hf}' has {VOCAB} tokens but model\.vocab_size=160"):
        _build(cfg)
    assert not (tmp_path / "run2" / "tokenizer").exists()  # refused before it is saved


def test_a_run_directory_that_is_the_checkpoints_own_is_refused(tmp_path, capsys, monkeypatch):
    hf = tiny_llama_dir(tmp_path, tokenizer=True)
    before = sorted(p.name for p in hf.iterdir())
    monkeypatch.chdir(tmp_path)
    for spelling in (str(hf), "hf/", "./hf"):
        with pytest.raises(ValueError, match=r"train\.run_dir=.* is the directory of model\.hf_path=.*give the run a "
                                             r"directory of its own \(e\.g\. train\.run_dir=runs/hf\)"):
            parse_args_to_config("tiny", [f"model.hf_path={hf}", f"train.run_dir={spelling}"])
    with pytest.raises(SystemExit):
        main(["train", "tiny", f"model.hf_path={hf}", f"train.run_dir={hf}", "model.seq_length=96"])
    assert "is the directory of model.hf_path" in capsys.readouterr().err
    assert sorted(p.name for p in hf.iterdir()) == before  # nothing written into the checkpoint
    assert parse_args_to_config("tiny", [f"model.hf_path={hf}", f"train.run_dir={tmp_path / 'run'}"])

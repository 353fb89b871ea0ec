"""Character tokenizer and local tokenizer loading (megatron_logra.data.tokenizer)."""

from __future__ import annotations

import json
import random
import string

import pytest

from megatron_logra.data.tokenizer import (
    TokenizerConfig,
    build_char_tokenizer,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
)


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["", " ", "  a  b  ", "\n\n\t x \r\n", " . , ! ? ", "x = 1 + 2 ;"]
    texts += ["".join(rng.choice(string.printable) for _ in range(rng.randint(1, 80))) for _ in range(n)]
    return texts


def test_special_token_ids(char_tok):
    assert (char_tok.pad_token_id, char_tok.bos_token_id, char_tok.eos_token_id) == (0, 1, 2)
    assert char_tok.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>"]) == [0, 1, 2]
    assert char_tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<bos>", "<eos>"]
    # every printable ASCII character has its own id, distinct from the specials and the unk id
    ids = char_tok.convert_tokens_to_ids(list(string.printable))
    assert len(set(ids)) == len(string.printable)
    assert min(ids) > 2 and char_tok.unk_token_id not in ids
    assert len(char_tok) == len(set(ids)) + 4


def test_round_trip_random_printable(char_tok):
    for text in _random_texts(200):
        ids = char_tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text), text  # one token per character, whitespace included
        assert char_tok.unk_token_id not in ids
        assert char_tok.decode(ids) == text
        with_bos = char_tok(text)["input_ids"]
        assert with_bos[0] == char_tok.bos_token_id and with_bos[1:] == ids
        assert char_tok.decode(with_bos, skip_special_tokens=True) == text


def test_texts_extend_vocabulary_without_moving_ascii(char_tok):
    extra = "5 × 3 − 1 = 14 ÷ é ü 😀"
    tok = build_char_tokenizer([extra, "naïve"])
    ids = tok(extra + "naïve", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == extra + "naïve"
    assert tok.convert_tokens_to_ids(list(string.printable)) == char_tok.convert_tokens_to_ids(list(string.printable))
    assert len(tok) == len(char_tok) + len(set("×−÷éü😀ï"))
    # without those texts the same characters are unknown
    base_ids = char_tok("×", add_special_tokens=False)["input_ids"]
    assert base_ids == [char_tok.unk_token_id]


def test_save_load_round_trip(tmp_path, char_tok):
    tok = build_char_tokenizer(["π≈3.14"])
    out = save_tokenizer(tok, tmp_path / "tok")
    loaded = load_tokenizer(out)
    texts = _random_texts(30, seed=1) + ["π≈3.14 and 2π"]
    for text in texts:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert len(loaded) == len(tok)
    # a bare tokenizer.json file loads too, with the same ids and specials
    from_file = load_tokenizer(out / "tokenizer.json")
    assert from_file("π x")["input_ids"] == tok("π x")["input_ids"]
    assert (from_file.pad_token_id, from_file.eos_token_id) == (0, 2)
    assert from_file.decode(from_file(" a  b ", add_special_tokens=False)["input_ids"]) == " a  b "


def test_local_hf_tokenizer_directory_loads(tmp_path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Tokenizer

    corpus = ["the quick brown fox jumps over the lazy dog"] * 10 + ["hello world 12345"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    merges = [tuple(m) for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]]
    hf = GPT2Tokenizer(vocab=bpe.get_vocab(), merges=merges)
    hf.save_pretrained(str(tmp_path / "gpt2-tiny"))

    loaded = load_tokenizer(tmp_path / "gpt2-tiny")
    assert type(loaded).__name__ == "GPT2Tokenizer"
    text = "the lazy fox says hello"
    assert loaded(text)["input_ids"] == hf(text)["input_ids"]
    assert len(loaded(text)["input_ids"]) < len(text)  # real BPE merges, not characters
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.pad_token == loaded.eos_token == "<|endoftext|>"  # pad falls back to eos


def test_missing_and_invalid_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "readme.txt").write_text("not a tokenizer")
    with pytest.raises(ValueError, match="junk"):
        load_tokenizer(junk)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(junk / "readme.txt")


def test_tokenizer_config(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.path"):
        TokenizerConfig(path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="extra_chars"):
        TokenizerConfig(path=str(tmp_path), extra_chars="×")
    tok = build_tokenizer(TokenizerConfig(extra_chars="×÷"), texts=["é"])
    ids = tok("6 × 2 ÷ é", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == "6 × 2 ÷ é"
    save_tokenizer(tok, tmp_path / "saved")
    again = build_tokenizer(TokenizerConfig(path=str(tmp_path / "saved")))
    assert again("÷ é")["input_ids"] == tok("÷ é")["input_ids"]


def test_prompts_start_with_bos_only_when_the_tokenizer_has_one():
    from megatron_logra.data.tokenizer import build_char_tokenizer, prompt_token_ids

    tok = build_char_tokenizer()
    body = tok("Q: 2+3=", add_special_tokens=False)["input_ids"]
    assert prompt_token_ids(tok, "Q: 2+3=") == [tok.bos_token_id] + body
    tok.bos_token = None  # like Qwen's tokenizers
    assert prompt_token_ids(tok, "Q: 2+3=") == body
    with pytest.raises(ValueError, match="tokenises to nothing"):
        prompt_token_ids(tok, "")


def test_stop_ids_add_the_checkpoints_generation_config(tmp_path):
    import json

    from megatron_logra.data.tokenizer import build_char_tokenizer, stop_token_ids

    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    assert stop_token_ids(tok) == [eos] and stop_token_ids(tok, "", tmp_path / "missing") == [eos]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [50, eos], "do_sample": True}))
    assert stop_token_ids(tok, ckpt) == sorted({eos, 50})
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_token_ids(tok, str(ckpt)) == sorted({eos, 7})
    for bad in ([len(tok)], ["2"], [True], -1):
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ValueError, match="eos_token_id"):
            stop_token_ids(tok, ckpt)
    (ckpt / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        stop_token_ids(tok, ckpt)
    tok.eos_token = None
    with pytest.raises(ValueError, match="could never stop"):
        stop_token_ids(tok)


def test_chat_prompts_follow_the_tokenizers_template():
    from megatron_logra.data.tokenizer import build_char_tokenizer, prompt_token_ids

    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="rl.chat_template=true but the tokenizer has no chat template"):
        prompt_token_ids(tok, "Q: 2+3=", chat=True)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    want = tok("<user>Q: 2+3=<assistant>", add_special_tokens=False)["input_ids"]
    assert prompt_token_ids(tok, "Q: 2+3=", chat=True) == want  # no BOS unless the template writes one

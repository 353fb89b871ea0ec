"""Tokenizers for the trainer: a built-in character tokenizer, or a local Hugging Face tokenizer.

Character tokenizer (:func:`build_char_tokenizer`), built with the ``tokenizers`` library and
wrapped in ``transformers.PreTrainedTokenizerFast``:

* model ``WordLevel`` whose vocabulary is ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then
  every printable ASCII character (``string.printable``, by code point), then every other
  character of ``texts`` / ``extra_chars`` (by code point) — so ASCII ids never depend on ``texts``;
* pre-tokenizer ``Split([\\s\\S], isolated)``: every character is its own token (spaces, tabs and
  newlines included); no normalizer;
* decoder ``Fuse`` (concatenate tokens, no separator) and ``clean_up_tokenization_spaces=False``,
  so ``decode(encode(text, add_special_tokens=False)) == text`` exactly for in-vocabulary text;
* post-processor: ``<bos>`` is prepended when ``add_special_tokens=True`` (the default), like
  Llama-family tokenizers; ``<eos>`` is never added automatically.

A character outside the vocabulary encodes to ``<unk>`` (and cannot round-trip).

Loading (:func:`load_tokenizer`): a directory saved by ``save_pretrained`` (ours or any local HF
tokenizer) via ``AutoTokenizer.from_pretrained(path, local_files_only=True)``, or a bare
``tokenizer.json`` file. Tokenizers without a pad token get ``pad_token = eos_token``.
A prompt's token ids and the ids that end a completion (:func:`prompt_token_ids`, :func:`stop_token_ids`) come from
:mod:`megatron_logra.data.token_ids`. Importing this module does not import transformers; the functions do.
"""

from __future__ import annotations

import logging
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from megatron_logra.data.token_ids import prompt_token_ids, stop_token_ids

if TYPE_CHECKING:  # transformers takes seconds to import; only the functions need it
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "TokenizerConfig",
    "build_char_tokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "prompt_token_ids",
    "save_tokenizer",
    "stop_token_ids",
]

logger = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens of the character tokenizer; their ids are their positions (0, 1, 2, 3)."""


@dataclass
class TokenizerConfig:
    """Which tokenizer the trainer uses."""

    path: str = ""
    """Local HF tokenizer directory (or a tokenizer.json file); empty = build the character tokenizer."""
    extra_chars: str = ""
    """Characters added to the character tokenizer beyond printable ASCII (e.g. "×÷−"); ignored with a path."""
    kind: str = "char"
    """Built tokenizer when path is empty: char (one token per character) or words (a BPE trained
    on the task's texts whose merges never cross a word: digits, spaces and punctuation stay single
    characters, so numbers are spelled digit by digit, while prompt boilerplate shrinks ~3x)."""
    vocab_size: int = 256
    """Vocabulary size of the words tokenizer (specials and printable ASCII included)."""

    def __post_init__(self) -> None:
        if self.kind not in ("char", "words"):
            raise ValueError(f"tokenizer.kind={self.kind!r}: choose char or words")
        if self.vocab_size < 128:
            raise ValueError(f"tokenizer.vocab_size={self.vocab_size} must be >= 128 (printable ASCII + specials)")
        if not isinstance(self.path, str):
            raise ValueError(f"tokenizer.path={self.path!r} must be a string (empty = character tokenizer)")
        if not isinstance(self.extra_chars, str):
            raise ValueError(f"tokenizer.extra_chars={self.extra_chars!r} must be a string of characters")
        if self.path.strip() and not Path(self.path).expanduser().exists():
            raise ValueError(
                f"tokenizer.path={self.path!r} does not exist: give a local HF tokenizer directory, a "
                f"tokenizer.json file, or '' for the built-in character tokenizer"
            )
        if self.path.strip() and self.extra_chars:
            raise ValueError("tokenizer.extra_chars applies only to the character tokenizer; clear tokenizer.path")


def _char_vocab(texts: Iterable[str] | None) -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(set(string.printable)):
        vocab.setdefault(ch, len(vocab))
    extra: set[str] = set()
    for text in texts or ():
        extra.update(text)
    for ch in sorted(extra):
        vocab.setdefault(ch, len(vocab))
    return vocab


def build_char_tokenizer(texts: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """Character-level tokenizer covering printable ASCII plus every character of ``texts``.

    Contract: ``<pad>``/``<bos>``/``<eos>``/``<unk>`` have ids 0/1/2/3; the vocabulary is a pure
    function of the *set* of characters in ``texts``; decoding in-vocabulary ids round-trips text
    exactly. See the module docstring for the pipeline.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = _char_vocab(texts)
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    ids = [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id]
    if ids != [0, 1, 2, 3]:  # transformers must not have re-added the specials elsewhere
        raise RuntimeError(f"character tokenizer special ids are {ids}, expected [0, 1, 2, 3]")
    logger.debug("character tokenizer: %d tokens", len(tok))
    return tok


def build_words_tokenizer(texts: Iterable[str], vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """A BPE over the characters of printable ASCII (+ ``texts``) whose merges stay inside
    ``" ?[A-Za-z]+"`` chunks, trained on ``texts`` with the ``tokenizers`` library.

    Same special ids as the character tokenizer (0..3); decoding round-trips text exactly; any
    text of known characters encodes (unknown words fall back to characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = list(texts)
    alphabet = sorted(set(string.printable) | {ch for text in corpus for ch in text})
    core = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[A-Za-z]+|[\s\S]"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, len(alphabet) + len(SPECIAL_TOKENS)),
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  show_progress=False, min_frequency=2)
    core.train_from_iterator(corpus, trainer)
    core.decoder = decoders.Fuse()
    bos_id = core.token_to_id(BOS_TOKEN)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN,
                                  eos_token=EOS_TOKEN, unk_token=UNK_TOKEN, clean_up_tokenization_spaces=False)
    ids = [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id]
    if ids != [0, 1, 2, 3]:
        raise RuntimeError(f"words tokenizer special ids are {ids}, expected [0, 1, 2, 3]")
    return tok


def save_tokenizer(tok: PreTrainedTokenizerBase, directory: str | Path) -> Path:
    """Save ``tok`` with ``save_pretrained`` into ``directory`` (created); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    return directory


def _ensure_pad(tok: PreTrainedTokenizerBase, where: str) -> PreTrainedTokenizerBase:
    if tok.pad_token is None and tok.eos_token is not None:
        logger.info("%s has no pad token; using its eos token %r for padding", where, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok


_VOCAB_FILE_NAMES = frozenset({"vocab.json", "vocab.txt", "merges.txt", "tekken.json", "special_tokens_map.json"})
"""Vocabulary files of HF tokenizer classes besides ``tokenizer*`` (BPE, WordPiece, Mistral's tekken; SentencePiece's
``*.model`` and tiktoken files are matched by suffix)."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a local tokenizer: a ``save_pretrained`` directory (any HF class) or a ``tokenizer.json``.

    Never touches the network (``local_files_only=True``). Raises FileNotFoundError for a missing
    path and ValueError when the path holds no loadable tokenizer (also a directory without tokenizer
    files, such as a checkpoint saved without its tokenizer). A tokenizer without a pad token
    gets its eos token as pad.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"tokenizer path {str(path)!r} does not exist: give a local HF tokenizer directory "
            f"(saved with save_pretrained) or a tokenizer.json file"
        )
    if p.is_file():
        if p.suffix != ".json":
            raise ValueError(f"tokenizer path {str(p)!r} is a file but not a tokenizer.json; give its directory")
        try:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(p), clean_up_tokenization_spaces=False)
        except Exception as exc:
            raise ValueError(f"tokenizer file {str(p)!r} could not be loaded: {exc}") from exc
        vocab = tok.get_vocab()
        specials = {"pad_token": PAD_TOKEN, "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
        tok.add_special_tokens({k: v for k, v in specials.items() if v in vocab})
        return _ensure_pad(tok, str(p))
    names = sorted(x.name for x in p.iterdir())
    if not any(n.startswith("tokenizer") or n in _VOCAB_FILE_NAMES or n.endswith((".model", ".tiktoken"))
               for n in names):
        # transformers >= 5 builds a tokenizer with an empty vocabulary from a bare config.json; every
        # prompt would then encode to nothing
        raise ValueError(
            f"tokenizer directory {str(p)!r} holds no tokenizer files (it holds {names[:10]}); expected files "
            f"written by save_pretrained (tokenizer.json / tokenizer_config.json): save the tokenizer there, "
            f"or give tokenizer.path=DIR"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:
        files = sorted(x.name for x in p.iterdir())[:10]
        raise ValueError(
            f"tokenizer directory {str(p)!r} could not be loaded ({type(exc).__name__}: {exc}); it holds {files}; "
            f"expected files written by save_pretrained (tokenizer.json / tokenizer_config.json)"
        ) from exc
    return _ensure_pad(tok, str(p))


def build_tokenizer(cfg: TokenizerConfig, texts: Iterable[str] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer ``cfg`` names: ``load_tokenizer(cfg.path)``, or the character tokenizer over
    ``texts`` plus ``cfg.extra_chars`` when ``cfg.path`` is empty."""
    cfg.__post_init__()
    if cfg.path.strip():
        return load_tokenizer(cfg.path)
    corpus = list(texts or ())
    if cfg.extra_chars:
        corpus.append(cfg.extra_chars)
    if cfg.kind == "words":
        return build_words_tokenizer(corpus, cfg.vocab_size)
    return build_char_tokenizer(corpus)

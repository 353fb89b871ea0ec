"""The token ids the RL job takes from a tokenizer: a prompt's (:func:`prompt_token_ids`) and those that end a
completion (:func:`stop_token_ids`).

A prompt starts with the tokenizer's BOS when it has one, then the text without special tokens, or is rendered by
the tokenizer's chat template as one user turn followed by the opened assistant turn; an empty prompt is a
``ValueError``. The stop ids are the tokenizer's EOS and every ``eos_token_id`` of a checkpoint's
``generation_config.json``; none at all is a ``ValueError``. Works with any Hugging Face tokenizer; imports no
transformers. Importable from :mod:`megatron_logra.data.tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["prompt_token_ids", "stop_token_ids"]


def prompt_token_ids(tok: PreTrainedTokenizerBase, text: str, *, chat: bool = False) -> list[int]:
    """``text`` tokenised as a prompt: the BOS token first when the tokenizer has one (Llama does;
    Qwen's has none), then the text without special tokens. With ``chat``, the tokenizer's chat
    template renders ``text`` as one user message followed by the opened assistant turn (the
    template decides BOS). ValueError for an empty result (a completion needs at least one token
    before it) or ``chat`` without a template."""
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError("rl.chat_template=true but the tokenizer has no chat template (a base checkpoint?): "
                             "set rl.chat_template=false")
        ids = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    else:
        ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + list(
            tok(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"the prompt {text[:60]!r} tokenises to nothing and the tokenizer has no BOS token: "
                         "give rl.prompt_template some text")
    return ids


def stop_token_ids(tok: PreTrainedTokenizerBase, *checkpoint_dirs: str | Path) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS and every ``eos_token_id`` of the
    ``generation_config.json`` in each existing ``checkpoint_dirs`` entry.

    Instruct checkpoints stop on more than their tokenizer's EOS (Qwen2.5-Instruct: ``<|im_end|>``
    and ``<|endoftext|>``; Llama-3.1-Instruct: three ids); stopping on the tokenizer's alone lets
    rollouts run on to ``max_new_tokens`` past the model's own end. A malformed file is a ValueError.
    """
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for d in checkpoint_dirs:
        path = Path(d).expanduser() / "generation_config.json" if str(d).strip() else None
        if path is None or not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{path} is not a JSON object: {exc}") from exc
        extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tok) for i in extra):
            raise ValueError(f"{path}: eos_token_id={eos!r} must be token ids of this tokenizer (< {len(tok)})")
        ids += extra
    if not ids:
        raise ValueError("the tokenizer has no EOS token and no generation_config.json names one: completions "
                         "could never stop before rl.rollout.max_new_tokens")
    return sorted(set(ids))

"""Stop strings of the embedded rollout engine (:class:`StopStrings`): which sequences a newly sampled token ends.

A sequence ends at the token whose decoded text completes one of ``SamplingParams.stop``: the engine keeps that
token and every one before it (``completion_ids`` and ``logprobs`` stay aligned), and the reward later sees the
decoded kept tokens, so the stop string is in the text it scores (with whatever the last token adds after it;
SGLang's ``output_ids`` keep those tokens too, and its text keeps the string with ``no_stop_trim``).

Only the tail of each live sequence is decoded per step: a stop string of ``n`` UTF-8 bytes spans at most ``n``
tokens (each token holds at least one byte of text), and one more token in front keeps the decoder's view of a
leading space (SentencePiece drops the space of a sequence's first word). Special tokens (the tokenizer's
``all_special_ids``) decode to nothing, so they do not count towards that many: the tail reaches back past them. The decoding is the reward's:
``tokenizer.decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

logger = logging.getLogger(__name__)

__all__ = ["StopStrings"]


class StopStrings:
    """Matches ``stops`` (non-empty strings) against the decoded tail of a sequence's completion tokens.

    ``tokenizer``: anything with ``decode(ids, skip_special_tokens=True)`` (a Hugging Face tokenizer). ``window``:
    the tokens decoded per check, the longest stop string's UTF-8 length + 1.
    """

    def __init__(self, stops: Sequence[str], tokenizer: Any) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"sampling.stop={list(stops)!r} must be a list of non-empty strings")
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError("sampling.stop (rl.rollout.stop) needs the engine's tokenizer to decode completions: "
                             "build the engine with tokenizer=... (build_engine passes the run's), or drop the "
                             "stop strings")
        self.stops = tuple(dict.fromkeys(stops))
        self.tokenizer = tokenizer
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 1
        self.special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def ends(self, completion: Sequence[int]) -> bool:
        """Whether the last token of ``completion`` (the ids sampled so far) completes a stop string: its decoded
        tail holds one (the steps before found none, so a match there ends at this token)."""
        tail = self.tokenizer.decode(self._tail(completion), skip_special_tokens=True)
        return any(s in tail for s in self.stops)

    def _tail(self, completion: Sequence[int]) -> list[int]:
        """The last ``window`` tokens of ``completion`` that are not special, with the special ones among them."""
        if not self.special:
            return list(completion[-self.window:])
        tail: list[int] = []
        plain = 0
        for token in reversed(completion):
            tail.append(token)
            plain += token not in self.special
            if plain == self.window:
                break
        return tail[::-1]

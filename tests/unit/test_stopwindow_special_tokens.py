"""Stop strings across special tokens: special tokens decode to nothing (``skip_special_tokens``), so the tail the
embedded engine decodes per step reaches back past them; a stop string whose characters special tokens separate is
matched at the token that completes it, as a plain scan of the decoded completion finds it."""

from __future__ import annotations

from megatron_logra.rollout.stop_strings import StopStrings

SPECIAL = 300


class _BytesWithSpecial:
    """Byte-level ids (< 256) and one special token (300), which decodes to nothing when skipped."""

    all_special_ids = [SPECIAL]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _first_end(strings: StopStrings, ids: list[int]):
    return next((j + 1 for j in range(len(ids)) if strings.ends(ids[: j + 1])), None)


def _reference(tok, stops, ids):
    """The first prefix whose whole decoded text holds a stop string (a plain scan)."""
    return next((j + 1 for j in range(len(ids))
                 if any(s in tok.decode(ids[: j + 1], skip_special_tokens=True) for s in stops)), None)


def test_special_tokens_between_the_characters_do_not_hide_the_stop_string():
    tok = _BytesWithSpecial()
    strings = StopStrings(["ab"], tok)
    ids = list(b"xa") + [SPECIAL] * 10 + list(b"b") + list(b"yz")
    assert _first_end(strings, ids) == _reference(tok, ["ab"], ids) == 13


def test_without_special_tokens_the_tail_is_the_window():
    tok = _BytesWithSpecial()
    strings = StopStrings(["abc"], tok)
    ids = list(b"zzabzzabczz")
    assert _first_end(strings, ids) == _reference(tok, ["abc"], ids) == 9
    assert strings._tail(ids) == ids[-strings.window:]

"""``JsonlSource.drop_unparsable_answers`` asks its parser once per row.

math-verify parses each gold answer under a timeout (a parse that times out counts as unparsable) and caches
only 4096 of them, so asking twice doubles the start of a large file's run (DeepScaleR: 40k rows) and can
get two answers for one row: the warning's count, the all-rows check and the rows kept must come from one
answer per row.
"""

from __future__ import annotations

import json
from collections import Counter

from megatron_logra.rewards.jsonl import JsonlSource


def _source(tmp_path, n: int) -> JsonlSource:
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(n)))
    return JsonlSource(str(path))


def test_each_answer_is_parsed_once(tmp_path):
    source = _source(tmp_path, 10)
    calls: Counter = Counter()

    def parses(answer: str) -> bool:
        calls[answer] += 1
        return answer != "4"

    assert source.drop_unparsable_answers(parses) == 1
    assert set(calls.values()) == {1}, calls
    assert source.size == len(source.problems) == 9


def test_the_rows_kept_are_those_counted(tmp_path):
    """A parser whose answer for a row changes between calls (a timeout the first time): the row counted as
    dropped is the row dropped."""
    source = _source(tmp_path, 6)
    seen: set = set()

    def flaky(answer: str) -> bool:
        first = answer not in seen
        seen.add(answer)
        return not (answer == "2" and first)

    dropped = source.drop_unparsable_answers(flaky)
    assert dropped == 1
    assert len(source.problems) == 6 - dropped
    assert "2" not in [p.answer for p in source.problems]

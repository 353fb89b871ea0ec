"""What a real RL step hands to ``pack_sequences``: the tests of the step's advantages and micro-batches read it."""

from __future__ import annotations


def record_packing(monkeypatch) -> list[dict]:
    """Patch ``rl.loop.pack_sequences`` (for the test's duration) to record each call: ``prompts``, ``completions``
    (lists of token ids), ``advantages`` and the packed ``batch`` it returned; returns the list it appends to."""
    import megatron_logra.rl.loop as loop

    calls: list[dict] = []
    real = loop.pack_sequences

    def spy(prompts, completions, **kw):
        batch = real(prompts, completions, **kw)
        calls.append({"prompts": [list(p) for p in prompts], "completions": [list(c) for c in completions],
                      "advantages": list(kw["advantages"]), "batch": batch})
        return batch

    monkeypatch.setattr(loop, "pack_sequences", spy)
    return calls

"""Memory planner: per-rank training memory (weights, optimizer state, activations, logits, a colocated
rollout engine) of a model at a parallel layout, dense AdamW vs LoGRA, before launching anything.

See ``docs/memory.md``. ``count`` builds the megatron model on the meta device for exact
parameter counts; ``planner`` is pure arithmetic on those counts; ``units`` parses sizes.
"""

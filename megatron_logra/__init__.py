"""megatron_logra: LoGRA low-rank gradient sketches for LLM reinforcement learning on megatron-core."""

__version__ = "0.1.0"

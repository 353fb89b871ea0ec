"""Model builders (megatron-core GPT) and layout maps."""

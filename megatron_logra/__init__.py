"""megatron_logra: LoGRA low-rank gradient sketches for LLM reinforcement learning on megatron-core."""

__version__ = "0.1.0"

from megatron_logra import cpu_shim as _cpu_shim  # noqa: E402

_cpu_shim.install_import_hook()

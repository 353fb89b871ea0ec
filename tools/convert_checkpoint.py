#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megatron-core layouts (same as ``megatron-logra convert``).

    python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out DIR [--tp N --pp M]
    python tools/convert_checkpoint.py mcore-to-hf --mcore DIR --out DIR [--hf-template DIR]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_logra.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="convert_checkpoint.py"))

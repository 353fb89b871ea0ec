"""``python -m megatron_logra.cli COMMAND ...`` (and ``torchrun ... -m megatron_logra.cli``): the
``megatron-logra`` command."""

import sys

from megatron_logra.cli import main

sys.exit(main())

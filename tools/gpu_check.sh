#!/usr/bin/env bash
# One-shot verification of the GPU paths on a CUDA node, within 10 minutes: environment report, the
# gpu-marked tests (the slow ones only when asked for), the smoke benchmark (LoGRA vs dense AdamW steps:
# memory and step time) and the engine-side sync timing (apply a sketch delta vs copy every weight, on the GPU).
#
#   bash tools/gpu_check.sh [OUT_DIR=runs/gpu-check] [WHEEL_DIR=wheelhouse]
#   GPU_CHECK_SLOW=1 bash tools/gpu_check.sh          # also the slow-marked GPU tests (up to 35 minutes)
#
# OUT_DIR and WHEEL_DIR are relative to the directory the script is run from (the defaults: to the checkout).
# WHEEL_DIR (from tools/offline_wheels.sh), when it exists, is installed into a private site directory
# first, for images that hold CUDA PyTorch but not megatron-core / reasoning-gym / math-verify (a WHEEL_DIR
# given but missing is named on stderr); env.txt reports these and the package's other requirements
# (transformers, tokenizers, safetensors, ...), which the image must hold. Logs go to
# OUT_DIR (env.txt, pytest.txt, smoke.txt, sync_apply.txt, summary.txt); exit status 1 when a test, the smoke
# check or the sync timing failed, ran out of time, or could not run because a file it needs is missing
# (named in its log and the summary). Without a CUDA device it still writes every file: the gpu-marked
# tests skip, the smoke check and the sync timing are not started, and the summary's first line says that
# nothing was checked on a GPU (exit status 0: the environment report and test collection worked).
# A PYTHON that cannot import torch is named in the summary's first line (NOT CHECKED), exit status 1.
#
# Env:
#   PYTHON          interpreter (default python3)
#   GPU_CHECK_SLOW  1: every gpu-marked test (pytest -m gpu), the slow ones included (SGLang HTTP servers, RL
#                   runs with SGLang rollouts: several engine starts, subprocesses with 600 s limits); default:
#                   pytest -m "gpu and not slow"
#   CHECK_BUDGET    seconds for the whole script (default 540; 2100 with GPU_CHECK_SLOW=1): a stage gets at
#                   most what is left of it, and one that finds it spent is reported as not run
#   TEST_TIMEOUT    the tests' own limit (default 360 s; 1800 s with GPU_CHECK_SLOW=1)
#   SMOKE_TIMEOUT   the smoke benchmark's (default 240 s)
#   SYNC_TIMEOUT    the sync timing's (default 180 s)
# A stage past its limit gets SIGTERM, its whole process group (SGLang's schedulers too) SIGKILL 15 s later.
set -uo pipefail

OUT=${1:-runs/gpu-check}
WHEELS=${2:-wheelhouse}
PY=${PYTHON:-python3}
# OUT_DIR and WHEEL_DIR given on the command line are relative to where the script is run from; the
# defaults to the checkout (the script works from there)
[[ $# -ge 1 && "$OUT" != /* ]] && OUT="$PWD/$OUT"
[[ $# -ge 2 && "$WHEELS" != /* ]] && WHEELS="$PWD/$WHEELS"
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT" || exit 2
SECONDS=0

if [[ "${GPU_CHECK_SLOW:-0}" == 1 ]]; then
  MARKERS="gpu"
  BUDGET=${CHECK_BUDGET:-2100}
  TEST_LIMIT=${TEST_TIMEOUT:-1800}
else
  MARKERS="gpu and not slow"
  BUDGET=${CHECK_BUDGET:-540}
  TEST_LIMIT=${TEST_TIMEOUT:-360}
fi

if [[ -d "$WHEELS" ]]; then
  site=$(mktemp -d /tmp/megatron-logra-site.XXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$WHEELS"/* \
    || { echo "installing $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif [[ $# -ge 2 ]]; then
  echo "WHEEL_DIR $WHEELS does not exist: nothing installed from it" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  else
    echo "nvidia-smi: not available"
  fi
  timeout -k 5 120 "$PY" -W ignore - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for name in ("megatron.core", "transformer_engine", "apex", "sglang", "reasoning_gym", "math_verify", "pynvml",
             "transformers", "tokenizers", "safetensors", "yaml", "rich", "tensorboard", "psutil"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:20s} {getattr(mod, '__version__', 'present')}")
    except Exception as exc:  # a broken optional package is reported, not fatal
        print(f"{name:20s} missing ({type(exc).__name__})")
try:  # megatron-core hides a TE it cannot use (version drift) behind two HAVE_TE flags: check both, with the reason
    from megatron_logra.models.te import te_import_problem, te_installed
    problem = te_import_problem() if te_installed() else "transformer_engine is not installed"
    print(f"{'mcore TE layer spec':20s} {'usable' if problem is None else 'NOT usable: ' + problem}")
except Exception as exc:
    print(f"{'mcore TE layer spec':20s} unknown ({type(exc).__name__}: {exc})")
try:
    import pytest
    print(f"{'pytest':20s} {pytest.__version__}")
except ImportError:
    print(f"{'pytest':20s} missing: the gpu-marked tests cannot run (pip install -e '.[dev]')")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# stage LIMIT LOG NEEDED CMD...: CMD (which runs the repository path NEEDED) under LIMIT seconds, or under
# what is left of CHECK_BUDGET when that is less, output in LOG; sets rc (124: out of time) and note
stage() {
  local limit=$1 log=$2 needed=$3 left=$((BUDGET - SECONDS))
  shift 3
  (( left < limit )) && limit=$left
  if [[ ! -e "$needed" ]]; then
    echo "MISSING: $needed is not in $PWD (an image built without it? docker/Dockerfile must copy it)" | tee "$log"
    rc=1 note="MISSING: $needed"
  elif (( limit < 10 )); then
    echo "NOT RUN: CHECK_BUDGET=${BUDGET}s is spent (${SECONDS}s so far)" | tee "$log"
    rc=124 note="not run: CHECK_BUDGET=${BUDGET}s spent"
  else
    timeout -k 15 "$limit" "$@" > "$log" 2>&1
    rc=$? note="limit ${limit}s"
    if (( rc == 124 || rc == 137 )); then
      echo "TIMED OUT after ${limit}s" | tee -a "$log"
      note="TIMED OUT after ${limit}s"
    fi
  fi
}

stage "$TEST_LIMIT" "$OUT/pytest.txt" tests/gpu "$PY" -m pytest -m "$MARKERS" tests/gpu -q -rs --durations=15 -p no:cacheprovider
tests_rc=$rc tests_note="-m '$MARKERS', $note"
tail -n 25 "$OUT/pytest.txt"

smoke_rc=0 smoke_note="no CUDA device: not run"
sync_rc=0 sync_note="no CUDA device: not run"
cuda=0 torch_ok=1
"$PY" -c "import torch" > /dev/null 2>&1 || torch_ok=0  # not "no CUDA device": nothing could look for one
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" > /dev/null 2>&1 && cuda=1
if (( cuda )); then
  stage "${SMOKE_TIMEOUT:-240}" "$OUT/smoke.txt" tools/gpu_smoke.py "$PY" tools/gpu_smoke.py
  smoke_rc=$rc smoke_note=$note
  cat "$OUT/smoke.txt"
  stage "${SYNC_TIMEOUT:-180}" "$OUT/sync_apply.txt" benchmarks/sync_bytes.py \
    "$PY" benchmarks/sync_bytes.py --device cuda --repeats 5 --out "$OUT/sync_apply.md"
  sync_rc=$rc sync_note=$note
  tail -n 8 "$OUT/sync_apply.txt"
else
  why="no CUDA device"
  (( torch_ok )) || why="$PY cannot import torch"
  smoke_note="$why: not run" sync_note="$why: not run"
  echo "$why: smoke benchmark not run" | tee "$OUT/smoke.txt"
  echo "$why: sync timing not run" | tee "$OUT/sync_apply.txt"
fi

{
  if (( ! torch_ok )); then
    echo "NOT CHECKED: $PY cannot import torch (env.txt says why), so whether this machine has a CUDA device is"
    echo "unknown; set PYTHON to the interpreter of the environment the project is installed in (PYTHON=.venv/bin/python)."
  elif (( ! cuda )); then
    echo "NO CUDA DEVICE: nothing was checked on a GPU. The gpu-marked tests skip, the smoke benchmark and the sync"
    echo "timing are not started; exit 0 here only means the environment report and test collection worked."
  fi
  echo "gpu-marked tests: exit $tests_rc ($tests_note) -- $(tail -n 1 "$OUT/pytest.txt")"
  echo "smoke benchmark: exit $smoke_rc ($smoke_note)"
  echo "sync apply vs copy on the GPU: exit $sync_rc ($sync_note)"
  echo "total: ${SECONDS}s of CHECK_BUDGET=${BUDGET}s"
} | tee "$OUT/summary.txt"
[[ $torch_ok -eq 1 && $tests_rc -eq 0 && $smoke_rc -eq 0 && $sync_rc -eq 0 ]]

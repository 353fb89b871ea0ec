#!/usr/bin/env bash
# One-shot verification of the GPU paths on a CUDA node, within a few minutes: environment report,
# the gpu-marked tests, the smoke benchmark (LoGRA vs dense AdamW steps: memory and step time) and the
# engine-side sync timing (apply a sketch delta vs copy every weight, on the GPU).
#
#   bash tools/gpu_check.sh [OUT_DIR=runs/gpu-check] [WHEEL_DIR=wheelhouse]
#
# WHEEL_DIR (from tools/offline_wheels.sh), when it exists, is installed into a private site directory
# first, for images that hold CUDA PyTorch but not megatron-core / reasoning-gym / math-verify. Logs go to
# OUT_DIR (env.txt, pytest.txt, smoke.txt, sync_apply.txt, summary.txt); exit status 1 when a test, the smoke
# check or the sync timing failed, or when a file one of them runs is missing (named in its log and the summary).
# Env: PYTHON (default python3), TEST_TIMEOUT (default 420 s), SMOKE_TIMEOUT (default 240 s),
# SYNC_TIMEOUT (default 180 s).
set -uo pipefail

OUT=${1:-runs/gpu-check}
WHEELS=${2:-wheelhouse}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"

if [[ -d "$WHEELS" ]]; then
  site=$(mktemp -d /tmp/megatron-logra-site.XXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$WHEELS"/* \
    || { echo "installing $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  else
    echo "nvidia-smi: not available"
  fi
  "$PY" -W ignore - <<'EOF'
import importlib, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for name in ("megatron.core", "transformer_engine", "apex", "sglang", "reasoning_gym", "math_verify", "pynvml"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:20s} {getattr(mod, '__version__', 'present')}")
    except Exception as exc:  # a broken optional package is reported, not fatal
        print(f"{name:20s} missing ({type(exc).__name__})")
try:  # megatron-core hides a TE it cannot use (version drift) behind HAVE_TE = False
    from megatron.core.models.gpt import gpt_layer_specs
    print(f"{'mcore TE layer spec':20s} {'usable' if getattr(gpt_layer_specs, 'HAVE_TE', False) else 'NOT usable'}")
except Exception as exc:
    print(f"{'mcore TE layer spec':20s} unknown ({type(exc).__name__})")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

missing() {  # missing PATH LOG: true (and PATH named in LOG) when PATH is not in this checkout or image
  [[ -e "$1" ]] && return 1
  echo "MISSING: $1 is not in $PWD (an image built without it? docker/Dockerfile must copy it)" | tee "$2"
  return 0
}

if missing tests/gpu "$OUT/pytest.txt"; then
  tests_rc=1
else
  timeout "${TEST_TIMEOUT:-420}" "$PY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
  tests_rc=$?
  tail -n 25 "$OUT/pytest.txt"
fi

smoke_rc=0
sync_rc=0
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if missing tools/gpu_smoke.py "$OUT/smoke.txt"; then
    smoke_rc=1
  else
    timeout "${SMOKE_TIMEOUT:-240}" "$PY" tools/gpu_smoke.py > "$OUT/smoke.txt" 2>&1
    smoke_rc=$?
    cat "$OUT/smoke.txt"
  fi
  if missing benchmarks/sync_bytes.py "$OUT/sync_apply.txt"; then
    sync_rc=1
  else
    timeout "${SYNC_TIMEOUT:-180}" "$PY" benchmarks/sync_bytes.py --device cuda --repeats 5 \
      --out "$OUT/sync_apply.md" > "$OUT/sync_apply.txt" 2>&1
    sync_rc=$?
    tail -n 8 "$OUT/sync_apply.txt"
  fi
else
  echo "no CUDA device: smoke benchmark not run" | tee "$OUT/smoke.txt"
  echo "no CUDA device: sync timing not run" | tee "$OUT/sync_apply.txt"
fi

{
  echo "gpu-marked tests: exit $tests_rc ($(tail -n 1 "$OUT/pytest.txt"))"
  echo "smoke benchmark: exit $smoke_rc$(grep -h '^MISSING' "$OUT/smoke.txt" | sed 's/^/ /')"
  echo "sync apply vs copy on the GPU: exit $sync_rc$(grep -h '^MISSING' "$OUT/sync_apply.txt" | sed 's/^/ /')"
} | tee "$OUT/summary.txt"
[[ $tests_rc -eq 0 && $smoke_rc -eq 0 && $sync_rc -eq 0 ]]

# Sourced by the GPU launchers (examples/train_*gpu*.sh, train_7b_multinode.sh): sets
#   EXTRA  overrides for the layer implementation chosen by IMPL (and FP8), and
#   CUDA_DEVICE_MAX_CONNECTIONS / OMP_NUM_THREADS for torchrun.
# Env: IMPL=local (default) | transformer_engine (the KL probe runs by finite differences there);
#      FP8=hybrid | e4m3: FP8 training GEMMs, which are TransformerEngine's: FP8 alone selects
#      IMPL=transformer_engine, and FP8 with IMPL=local is refused (exit 2).
#      DATA=jsonl:/data/train.jsonl (task.datasets: jsonl:/parquet: files or reasoning-gym names, comma-separated)
#      and EVAL_DATA=jsonl:/data/math500.jsonl (task.eval_datasets: held-out benchmarks of their own).
# Call `gpu_impl_args 1` where TP > 1 allows sequence parallelism.
gpu_impl_args() {
  local sequence_parallel="${1:-0}"
  EXTRA=()
  if [[ -n "${FP8:-}" ]]; then
    case "${IMPL:-transformer_engine}" in
      transformer_engine) IMPL=transformer_engine ;;
      *) echo "FP8=$FP8 needs IMPL=transformer_engine (FP8 GEMMs are TransformerEngine's; IMPL=$IMPL would" \
              "train in bf16): drop IMPL or FP8" >&2; exit 2 ;;
    esac
  fi
  case "${IMPL:=local}" in
    local) ;;
    transformer_engine)
      EXTRA+=(model.transformer_impl=transformer_engine)
      if [[ "$sequence_parallel" == 1 ]]; then EXTRA+=(model.sequence_parallel=true); fi
      if [[ -n "${FP8:-}" ]]; then EXTRA+=("model.fp8=$FP8"); fi
      ;;
    *) echo "IMPL=$IMPL: choose local or transformer_engine" >&2; exit 2 ;;
  esac
  if [[ -n "${DATA:-}" ]]; then EXTRA+=("task.datasets=$DATA"); fi
  if [[ -n "${EVAL_DATA:-}" ]]; then EXTRA+=("task.eval_datasets=$EVAL_DATA"); fi
  export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
}

"""Every flag slime defines gets a deliberate answer here: run through the parser with a plausible value, none is an
"unknown option" (it sets a field, is accepted with a logged reason, is accepted at its one matching value, or is
refused naming what to use).

``SLIME_FLAGS`` is the list of slime's ``slime/utils/arguments.py`` (every ``add_argument`` and ``reset_arg`` of its
argument groups: cluster, train, rollout, fault tolerance, data, eval, algorithm, on-policy distillation, W&B,
TensorBoard, debug, network, reward model, rollout buffer, MTP, CI, Megatron plugins; the flags its ``_pre_parse_mode``
reads) and the four of ``slime/backends/sglang_utils/arguments.py`` that are not SGLang's own server arguments, each
with the value the check gives it (None: a switch)."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config
from megatron_logra.megatron_flags import CONTEXT_FLAGS, known_flags

SLIME_FLAGS: list[tuple[str, str | None]] = [
 # cluster
 ("actor-num-nodes","1"),("actor-num-gpus-per-node","8"),("rollout-num-gpus","8"),("rollout-num-gpus-per-engine","2"),
 ("num-gpus-per-node","8"),("colocate",None),("offload",None),("offload-train",None),("no-offload-train",None),
 ("offload-rollout",None),("no-offload-rollout",None),("distributed-backend","nccl"),("distributed-timeout-minutes","10"),
 # train
 ("post-self-attn-layernorm",None),("post-mlp-layernorm",None),("use-gated-attention",None),("qwen-gdn-backend","fla"),
 ("train-env-vars",'{"A":"1"}'),("force-fp8-ue8m0-scale",None),("update-weight-mode","full"),
 ("update-weight-transport","nccl"),("release-train",None),("update-weight-disk-dir","/tmp/w"),
 ("update-weight-disk-keep-files",None),("update-weight-delta-encoding","xor"),("update-weight-delta-checksum","xxh3-128"),
 ("custom-update-weight-post-write-path","a.b.c"),("update-weight-local-checkpoint-dir","/tmp/l"),
 ("custom-model-provider-path","a.b.c"),("recompute-loss-function",None),("log-probs-chunk-size","1024"),
 ("only-train-params-name-list","experts"),("freeze-params-name-list","embedding"),("freeze-indexer",None),
 ("allgather-cp",None),
 # rollout
 ("hf-checkpoint","/m"),("model-name","qwen2"),("flush-cache-interval","1"),("rollout-function-path","a.b.c"),
 ("rollout-temperature","0.8"),("rollout-top-p","0.9"),("rollout-top-k","-1"),("rollout-max-context-len","4096"),
 ("rollout-max-prompt-len","512"),("rollout-max-response-len","256"),("rollout-skip-special-tokens",None),
 ("rollout-stop","</answer>"),("rollout-stop-token-ids","5"),("rollout-shuffle",None),("rollout-seed","42"),
 ("over-sampling-batch-size","32"),("dynamic-sampling-filter-path","slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"),
 ("partial-rollout",None),("mask-offpolicy-in-partial-rollout",None),("custom-generate-function-path","a.b.c"),
 ("rollout-sample-hook-path","a.b.c"),("custom-rollout-log-function-path","a.b.c"),
 ("custom-eval-rollout-log-function-path","a.b.c"),("buffer-filter-path","a.b.c"),("buffer-sort-by-staleness",None),
 ("update-weight-buffer-size","536870912"),("rollout-data-postprocess-path","a.b.c"),
 ("rollout-data-transport","object-store"),("rollout-data-dir","/tmp/r"),("rollout-storage-profile","local"),
 ("rollout-storage-declaration","/tmp/d.json"),("rollout-queue-run-id","rollout"),("rollout-queue-online-gc",None),
 ("rollout-queue-lease-seconds","300"),("rollout-queue-segment-mib","1024"),("rollout-io-concurrency","4"),
 ("rollout-external-engine-addrs","127.0.0.1:30000"),
 # fault tolerance
 ("rollout-session-id","s"),("use-fault-tolerance",None),("rollout-health-check-interval","600"),
 ("rollout-health-check-timeout","600"),("rollout-health-check-first-wait","600"),("rollout-cleanup-timeout","60"),
 # data
 ("num-rollout","100"),("num-epoch","1"),("data-source-path","a.b.C"),("prompt-data","/d.jsonl"),
 ("apply-chat-template",None),("apply-chat-template-kwargs",'{"enable_thinking":false}'),("input-key","prompt"),
 ("label-key","label"),("multimodal-keys",'{"image":"image_file"}'),("metadata-key","metadata"),("tool-key","tools"),
 ("start-rollout-id","0"),("rollout-batch-size","32"),("n-samples-per-prompt","8"),("global-batch-size","256"),
 ("num-steps-per-rollout","1"),("micro-batch-size","1"),("balance-data",None),("balance-by-flops",None),
 ("use-dynamic-batch-size",None),("max-tokens-per-gpu","4096"),("log-probs-max-tokens-per-gpu","8192"),
 # eval
 ("eval-function-path","a.b.c"),("eval-interval","5"),("eval-prompt-data","aime /d.jsonl"),("eval-config","/e.yaml"),
 ("skip-eval-before-train",None),("eval-input-key","prompt"),("eval-label-key","label"),("eval-tool-key","tools"),
 ("n-samples-per-eval-prompt","4"),("eval-temperature","0.6"),("eval-top-p","0.7"),("eval-top-k","-1"),
 ("eval-max-response-len","512"),("eval-max-prompt-len","512"),("eval-min-new-tokens","1"),("eval-max-context-len","4096"),
 # algo
 ("pg-loss-type","ppo"),("use-score-centering",None),("score-centering-top-k","128"),("ref-load","/ref"),
 ("ref-ckpt-step","0"),("load","/tmp/run"),("save","/tmp/run"),("save-interval","20"),("async-save",None),
 ("no-save-optim",None),("save-hf","/tmp/hf_{rollout_id}"),("seed","1234"),("clip-grad","1.0"),
 ("calculate-per-token-loss",None),("lr","1e-6"),("num-critic-only-steps","0"),("megatron-config-path","/m.yaml"),
 ("eps-clip","0.2"),("eps-clip-high","0.28"),("eps-clip-c","3"),("value-clip","0.2"),("kl-coef","0"),
 ("loss-type","policy_loss"),("custom-loss-function-path","a.b.c"),("kl-loss-type","low_var_kl"),
 ("advantage-estimator","grpo"),("disable-compute-advantages-and-returns",None),("custom-advantage-function-path","a.b.c"),
 ("use-kl-loss",None),("kl-loss-coef","0.01"),("use-unbiased-kl",None),("ref-update-interval","10"),
 ("entropy-coef","0"),("gamma","1.0"),("lambd","1.0"),("normalize-advantages",None),
 ("disable-grpo-std-normalization",None),("disable-rewards-normalization",None),("use-rollout-entropy",None),
 ("get-mismatch-metrics",None),("reset-optimizer-states",None),("use-stateless-adam",None),("use-rollout-logprobs",None),
 ("use-tis",None),("tis-clip","2"),("tis-clip-low","0"),("custom-tis-function-path","a.b.c"),
 ("custom-pg-loss-reducer-function-path","a.b.c"),("use-routing-replay",None),("use-rollout-routing-replay",None),
 ("routing-replay-prefetch-microbatches","1"),("use-opsm",None),("opsm-delta","1e-4"),
 # opd
 ("use-opd",None),("opd-type","sglang"),("opd-kl-coef","1.0"),("opd-teacher-load","/t"),("opd-teacher-ckpt-step","0"),
 # wandb
 ("use-wandb",None),("wandb-mode","offline"),("wandb-dir","/tmp/wandb"),("wandb-key","k"),("wandb-host","https://h"),
 ("wandb-team","team"),("wandb-group","g"),("wandb-project","p"),("disable-wandb-random-suffix",None),
 ("wandb-always-use-train-step",None),("log-multi-turn",None),("log-passrate",None),("log-reward-category","reason"),
 ("log-correct-samples",None),("wandb-run-id","abc"),
 # tensorboard
 ("use-tensorboard",None),("tb-project-name","tb"),("tb-experiment-name","exp"),
 # debug
 ("save-debug-rollout-data","/tmp/r_{rollout_id}.pt"),("load-forge-rollout-data","/tmp/f.pt"),
 ("load-debug-rollout-data-subsample","0.5"),("save-debug-train-data","/tmp/t_{rollout_id}.pt"),("dump-details","/tmp/dd"),
 ("memory-snapshot-dir","."),("memory-snapshot-num-steps","2"),("memory-recorder","torch"),("record-memory-history",None),
 ("check-weight-update-equal",None),
 # network
 ("http-proxy","http://p:1"),("use-distributed-post",None),
 # reward model
 ("rm-type","math"),("reward-key","score"),("eval-reward-key","score"),("group-rm",None),("rm-url","http://h:1/r"),
 ("custom-rm-path","a.b.c"),("custom-reward-post-process-path","a.b.c"),("custom-convert-samples-to-train-data-path","a.b.c"),
 # rollout buffer
 ("rollout-buffer-url","http://h:1"),("fetch-trajectory-retry-times","-1"),("min-batch-collection-ratio","1"),
 ("rollout-task-type","math"),("loss-mask-type","qwen"),("data-pad-size-multiplier","128"),
 ("rollout-sample-filter-path","a.b.c"),("rollout-all-samples-process-path","a.b.c"),
 # mtp
 ("mtp-num-layers","1"),("mtp-loss-scaling-factor","0.2"),("enable-mtp-training",None),
 # ci
 ("ci-test",None),("ci-disable-kl-checker",None),("ci-train-rollout-logprob-abs-diff-threshold","0.1"),
 ("ci-save-grad-norm","/tmp/g"),("ci-load-grad-norm","/tmp/g"),
 # megatron plugins
 ("custom-megatron-init-path","a.b.c"),("custom-megatron-before-log-prob-hook-path","a.b.c"),
 ("custom-megatron-before-train-step-hook-path","a.b.c"),("megatron-deepgemm-forward-layers","0"),
 ("megatron-deepgemm-forward-modules","linear_fc1"),("megatron-deepgemm-moe-forward-layers","0"),
 ("megatron-deepgemm-moe-forward-modules","mlp.experts"),
 ("custom-config-path","/c.yaml"),("padded-vocab-size","151936"),
 # pre-parsed
 ("train-backend","megatron"),("debug-rollout-only",None),("debug-train-only",None),("load-debug-rollout-data","/tmp/r.pt"),
 # sglang utils
 ("sglang-router-ip","127.0.0.1"),("sglang-router-port","30000"),("sglang-router-request-timeout-secs","14400"),
 ("sglang-server-concurrency","512"),
]


def _outcome(flag: str, value: str | None) -> str:
    """``"ok"`` or the error message of ``--flag [value words]`` on the qwen2.5-1.5b recipe."""
    words = [f"--{flag}"] + ([] if value is None else value.split(" "))
    try:
        parse_args_to_config("qwen2.5-1.5b", words)
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_the_list_holds_each_flag_once():
    names = [flag for flag, _ in SLIME_FLAGS]
    assert len(names) == len(set(names)) == 245


@pytest.mark.parametrize("flag,value", SLIME_FLAGS, ids=[flag for flag, _ in SLIME_FLAGS])
def test_every_slime_flag_has_a_deliberate_answer(flag, value):
    outcome = _outcome(flag, value)
    assert "unknown option" not in outcome, outcome
    if not flag.startswith("sglang-"):  # SGLang's server arguments have one generic answer
        assert flag in known_flags() or flag in CONTEXT_FLAGS, f"--{flag} is answered by no table"

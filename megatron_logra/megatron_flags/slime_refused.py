"""slime's flags this trainer runs at one value only (neutral) or cannot honour (refused, naming what to use).

They are merged into :data:`~megatron_logra.megatron_flags.NEUTRAL_FLAGS`,
:data:`~megatron_logra.megatron_flags.REFUSED_SWITCHES` and :data:`~megatron_logra.megatron_flags.REFUSED_VALUE_FLAGS`
(through :mod:`~megatron_logra.megatron_flags.slime`). A refusal says it is a slime flag (``--prompt-data is a slime
flag this trainer cannot honour: ...``) and names the field or command that does the job here; a neutral flag's
other values are refused with why. Plain tables, importing only :mod:`~megatron_logra.megatron_flags.slime_ignored`.
"""

from __future__ import annotations

from typing import Any

from megatron_logra.megatron_flags.slime_ignored import ONE_STEP

__all__ = ["SLIME_NEUTRAL_FLAGS", "SLIME_REFUSED_SWITCHES", "SLIME_REFUSED_VALUE_FLAGS"]

_MOE = "mixture-of-experts models are not supported (dense GPT only)"
_HOOK = "custom functions are not called here: "
_ROLLOUT = "rollouts come from the configured engine (rl.rollout.engine: embedded or sglang)"
_ADVANTAGE = ("the advantages are rl.advantage.* (--advantage-estimator grpo / gspo / reinforce_plus_plus_baseline, "
              "--disable-grpo-std-normalization, --disable-rewards-normalization, --normalize-advantages)")
_LOSS = "the RL job's loss is rl.loss.kind (tis, ppo or gspo: --use-tis / --eps-clip / --advantage-estimator gspo)"
_LENGTH = ("the prompt and completion share model.seq_length positions (--seq-length N); give it, with "
           "--rollout-max-response-len (rl.rollout.max_new_tokens) and --eval-max-response-len within it")
_KEYS = ("held-out files are read with the training files' keys, --input-key / --label-key (task.jsonl_prompt_key / "
         "task.jsonl_answer_key); give those, or use files with the same keys")
_TOOLS = "tools are not passed to the chat template (single-turn rollouts without tool calls)"
_REF = ("the reference policy is model.hf_path's weights (a Hugging Face directory; `megatron-logra convert "
        "mcore-to-hf` writes one from a torch_dist checkpoint)")
_DEBUG = "every run generates its rollouts and trains on them; give rl.steps=N (--num-rollout N) for a short run"
_OPD = "on-policy distillation is not supported; the RL job learns from task.reward only"

SLIME_NEUTRAL_FLAGS: dict[str, tuple[type, Any, str]] = {
    "train-backend": (str, "megatron", "the trainer is megatron-core's (there is no FSDP backend)"),
    "expert-tensor-parallel-size": (int, 1, _MOE),
    "kl-coef": (float, 0.0, "a KL penalty in the reward is not supported: the KL to the initial policy is a loss "
                            "term, rl.loss.kl_coef=C (slime's --use-kl-loss --kl-loss-coef C), with "
                            "rl.loss.kl_estimator k3 or k2"),
    "update-weights-interval": (int, 1, "the rollout engine's weights are synced with the trainer's after every RL "
                                        "step (sync.*), so each step's rollouts come from the current policy; "
                                        "rollouts of a policy several steps old are not supported"),
    "flush-cache-interval": (int, 1, "the engine takes each step's weights between rollouts (its cache flushed); "
                                     "generation across weight updates (PipelineRL) is not supported"),
    "rollout-top-k": (int, -1, "top-k sampling is not supported: rollouts sample at rl.rollout.temperature and "
                               "top_p (--rollout-temperature, --rollout-top-p)"),
    "eval-top-k": (int, -1, "top-k sampling is not supported; top-k 1 is greedy decoding: give --eval-temperature 0 "
                            "(rl.rollout.eval_temperature=0) instead"),
    "pg-loss-type": (str, "ppo", "slime's REINFORCE score-centering objective is not supported: " + _LOSS),
    "num-critic-only-steps": (int, 0, "there is no value critic (slime's --advantage-estimator ppo)"),
    "start-rollout-id": (int, 0, "a new run starts at step 0; --resume RUN_DIR (--load RUN_DIR) continues a run "
                                 "from its latest checkpoint's step"),
    "metadata-key": (str, "metadata", "a jsonl: row's metadata is its \"metadata\" object (with its other keys)"),
    "mtp-num-layers": (int, 0, "multi-token prediction (MTP) layers are not supported"),
}
"""slime value flags accepted (and ignored) at the one value that matches this trainer."""

SLIME_REFUSED_SWITCHES: dict[str, str] = {
    "partial-rollout": ("every rollout of a step completes within the step (responses stop at "
                        "rl.rollout.max_new_tokens, --rollout-max-response-len); none is carried to the next step"),
    "use-opsm": "off-policy sequence masking is not supported: " + ONE_STEP,
    "use-routing-replay": _MOE,
    "use-rollout-routing-replay": _MOE,
    "post-self-attn-layernorm": ("the layers here have pre-norms only (the architecture follows model.hf_path's "
                                 "config.json); extra post-attention norms are not supported"),
    "post-mlp-layernorm": ("the layers here have pre-norms only (the architecture follows model.hf_path's "
                           "config.json); extra post-MLP norms are not supported"),
    "use-gated-attention": "gated attention outputs (Qwen3-Next's) are not supported",
    "freeze-indexer": "sparse attention indexers (DSA) are not supported (dense attention only)",
    "force-fp8-ue8m0-scale": "FP8 rollout weights are not supported: the engine runs the trainer's weights as they are",
    "release-train": ("the trainer stays resident beside the in-process engine; its memory is planned with "
                      "`megatron-logra memory --engine-fraction`"),
    "disable-compute-advantages-and-returns": _ADVANTAGE + "; for supervised training use the warm start (sft.*)",
    "use-unbiased-kl": ("the KL term is rl.loss.kl_coef × rl.loss.kl_estimator (--kl-loss-coef, --kl-loss-type "
                        "k1 / k2 / k3 / low_var_kl); its importance-weighted form is not supported"),
    "reset-optimizer-states": ("the optimizer state carries over every step; LoGRA's "
                               "optimizer.logra.refresh redraws its sketch each step"),
    "use-stateless-adam": "the optimizer is optimizer.name (--optimizer) with its own state",
    "use-score-centering": "slime's REINFORCE score-centering objective is not supported: " + _LOSS,
    "use-opd": _OPD,
    "no-save-optim": "a checkpoint holds the optimizer state, which --resume RUN_DIR needs",
    "debug-rollout-only": _DEBUG,
    "debug-train-only": _DEBUG,
    "enable-mtp-training": "multi-token prediction (MTP) layers are not supported",
}
"""slime switches this trainer cannot honour: refused, with what to use instead."""

SLIME_REFUSED_VALUE_FLAGS: dict[str, str] = {
    "rollout-function-path": _ROLLOUT + "; a custom rollout function is not supported",
    "custom-generate-function-path": _ROLLOUT + "; a custom generate function is not supported",
    "custom-tis-function-path": ("the importance weight is min(π_θ / μ, rl.loss.tis_cap) (--tis-clip); a custom "
                                 "weighting is not supported"),
    "wandb-key": ("W&B reads its key from WANDB_API_KEY (or `wandb login`); a key given on the command line would "
                  "be written to config.yaml and the launch logs"),
    "wandb-host": "W&B reads its server from WANDB_BASE_URL (or `wandb login --host URL`)",
    "wandb-mode": ("W&B reads its mode from WANDB_MODE (export WANDB_MODE=offline, then `wandb sync`); "
                   "without --wandb-project nothing goes to W&B"),
    "wandb-run-id": "--resume RUN_DIR continues the W&B run whose id RUN_DIR/wandb_run_id holds",
    "hf-checkpoint": ("give model.hf_path=DIR (job=rl): the run reads the Hugging Face checkpoint's architecture, "
                      "tokenizer and initial weights from it (slime's --hf-checkpoint only seeds SGLang and the "
                      "tokenizer, its weights coming from --ref-load / --load)"),
    "ref-load": "the initial and " + _REF + "; to continue a run of this trainer give --load RUN_DIR",
    "ref-ckpt-step": _REF,
    "ref-update-interval": _REF + ", fixed for the whole run",
    "opd-type": _OPD,
    "opd-teacher-load": _OPD,
    "prompt-data": ("the RL job's prompts are task.datasets: jsonl:PATH for a file of prompt / answer rows (several, "
                    "comma-separated, mixed by task.weights) or reasoning-gym names"),
    "num-epoch": "give the run's length in RL steps: --num-rollout N (rl.steps), each step rl.prompts_per_step prompts",
    "eval-prompt-data": ("held-out benchmarks are task.eval_datasets=jsonl:PATH[,jsonl:PATH2] (slime's NAME PATH "
                         "pairs without the names: each file is reported as eval_accuracy/jsonl:FILE), up to "
                         "task.num_eval rows of each"),
    "eval-config": "held-out benchmarks are task.eval_datasets=jsonl:PATH[,...], up to task.num_eval rows of each",
    "eval-input-key": _KEYS,
    "eval-label-key": _KEYS,
    "tool-key": _TOOLS,
    "eval-tool-key": _TOOLS,
    "apply-chat-template-kwargs": ("--apply-chat-template (rl.chat_template=true) applies the tokenizer's template "
                                   "with its defaults; keyword arguments to it are not supported (edit the "
                                   "template in the tokenizer's files, or use rl.prompt_template)"),
    "multimodal-keys": "the RL job's prompts are text only",
    "rollout-max-context-len": _LENGTH,
    "eval-max-context-len": _LENGTH,
    "eval-min-new-tokens": "a minimum completion length is not supported; a completion ends at its stop token",
    "loss-type": _LOSS + " with the KL penalty rl.loss.kl_coef; the LM job's is the language-model loss (job=lm)",
    "custom-loss-function-path": _HOOK + _LOSS,
    "custom-pg-loss-reducer-function-path": (_HOOK + "the loss is summed over the completion tokens and divided by "
                                             "the step's token count over every DP rank"),
    "custom-advantage-function-path": _HOOK + _ADVANTAGE,
    "custom-reward-post-process-path": _HOOK + _ADVANTAGE,
    "custom-convert-samples-to-train-data-path": _HOOK + "the rollouts become training data as " + ONE_STEP,
    "rollout-sample-hook-path": _HOOK + "a sample's reward is task.reward's (--custom-rm-path a.b.fn: "
                                        "task.reward=slime:a.b.fn)",
    "rollout-sample-filter-path": _HOOK + "every completion of a step is trained on (rl.dynamic_sampling_rounds "
                                          "replaces groups of equal rewards)",
    "rollout-all-samples-process-path": _HOOK + "the step's record summarises its rollouts (rl.log_samples=N "
                                                "writes N of them to RUN/samples.jsonl)",
    "rollout-data-postprocess-path": _HOOK + "the loss mask is each completion's generated tokens",
    "buffer-filter-path": _HOOK + "there is no buffer of older rollouts: " + ONE_STEP,
    "data-source-path": _HOOK + "the prompts are task.datasets (jsonl:PATH or reasoning-gym names)",
    "eval-function-path": _HOOK + "the held-out evaluation generates from task.eval_datasets with the rollout engine",
    "custom-model-provider-path": _HOOK + "the model is megatron-core's GPT built from model.hf_path's config.json",
    "custom-megatron-init-path": _HOOK + "the trainer is configured by the recipe and its fields",
    "custom-megatron-before-log-prob-hook-path": _HOOK + "the trainer is configured by the recipe and its fields",
    "custom-megatron-before-train-step-hook-path": _HOOK + "the trainer is configured by the recipe and its fields",
    "custom-update-weight-post-write-path": (_HOOK + "with sync.transport=directory the weight files are written "
                                             "atomically to sync.directory"),
    "custom-config-path": "give the fields in a recipe file: megatron-logra train FILE.yaml (base: a named recipe)",
    "megatron-config-path": "there is no value critic (slime's --advantage-estimator ppo); the recipe is the config",
    "train-env-vars": ("export the variables before `megatron-logra train` (torchrun passes its environment to "
                       "every rank)"),
    "only-train-params-name-list": ("the trained weights are optimizer.logra.targets (LoGRA's layers) and the "
                                    "other parameters unless optimizer.native.freeze=true"),
    "freeze-params-name-list": ("the trained weights are optimizer.logra.targets (LoGRA's layers) and the other "
                                "parameters unless optimizer.native.freeze=true"),
    "megatron-deepgemm-forward-layers": "FP8 DeepGEMM forwards are not supported (model.fp8 is TransformerEngine's)",
    "megatron-deepgemm-forward-modules": "FP8 DeepGEMM forwards are not supported (model.fp8 is TransformerEngine's)",
    "megatron-deepgemm-moe-forward-layers": _MOE,
    "megatron-deepgemm-moe-forward-modules": _MOE,
    "padded-vocab-size": ("the embedding's rows are model.vocab_size (--vocab-size) padded to a multiple of "
                          "model.make_vocab_size_divisible_by × TP (--make-vocab-size-divisible-by)"),
    "save-hf": ("`megatron-logra convert mcore-to-hf --mcore DIR --out DIR` writes a Hugging Face directory from a "
                "checkpoint of the run, after or during training"),
    "rollout-external-engine-addrs": ("give a running SGLang server: rl.rollout.engine=sglang "
                                      "rl.rollout.sglang_url=http://HOST:PORT (one server)"),
    "rollout-buffer-url": "rollouts come from the configured engine (rl.rollout.engine); there is no rollout buffer",
    "load-debug-rollout-data": _DEBUG,
    "load-forge-rollout-data": _DEBUG,
    "http-proxy": "the reward server (--rm-url) is called through the environment's proxy: export http_proxy / https_proxy",
    "reward-key": ("a reward server's answer is read at its \"reward\" or \"score\" key (or is the number itself); a "
                   "slime reward function (--custom-rm-path) returns the reward itself"),
    "eval-reward-key": "the held-out evaluation scores with the training reward (task.reward)",
}
"""slime value flags this trainer cannot honour: refused, with what to use instead."""

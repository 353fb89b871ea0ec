"""In-process rollout engine: a ``transformers`` causal LM with KV-cached, batched sampling.

The engine owns its own copy of the policy, built from
:func:`megatron_logra.models.hf.hf_config_from_model_config` (random init until
:meth:`EmbeddedEngine.update_weights_full`). ``generate`` left-pads the batch, passes an
attention mask and per-row position ids (``cumsum(mask) - 1``, so every prompt starts at
position 0 whatever its padding), runs the prompt once (once per distinct prompt: rows that repeat a
prompt, as a GRPO group does, copy its logits and KV cache), then decodes one token per step
through ``past_key_values``. Sampling (greedy, temperature, top-p, stop tokens and stop strings) draws from one
``torch.Generator`` seeded with ``SamplingParams.seed``: the same prompts, params and weights
give the same rollouts (a different batch composition may give different draws).
Padded vocabulary columns (beyond ``ModelConfig.vocab_size``) get the logit
``models.gpt.PADDED_LOGIT`` on both sides (engine ``lm_head`` and megatron ``output_layer``), so they
are never sampled and rollout and trainer log-probs describe the same distribution.
Log-prob convention: see :mod:`megatron_logra.rollout.engine`.
Weight loading, deltas and fingerprints are in :mod:`megatron_logra.rollout.embedded_weights`,
generation and scoring in :mod:`megatron_logra.rollout.embedded_generation`, sampling in
:mod:`megatron_logra.rollout.sampling`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional, Union

import torch

from megatron_logra.models.gpt import ModelConfig, mask_padded_vocab
from megatron_logra.models.hf import hf_config_from_model_config
from megatron_logra.rollout.embedded_generation import EmbeddedGeneration
from megatron_logra.rollout.embedded_weights import EmbeddedWeights

from transformers import AutoModelForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedEngine"]


class EmbeddedEngine(EmbeddedWeights, EmbeddedGeneration):
    """A real generator running a ``transformers`` copy of the policy in this process.

    ``cfg`` fixes the architecture (see :func:`hf_config_from_model_config`; unsupported
    configs raise ``ValueError``). ``dtype``/``device`` place the model; ``attn_implementation``
    is passed to transformers ("sdpa" or "eager"); ``init_seed`` makes the random initial
    weights reproducible without touching the global RNG; ``tp`` is the trainer's TP degree, which
    fixes the padded vocabulary (``cfg.padded_vocab_size(tp)``). ``weight_version`` starts at 0.
    ``vocab_rows``: the rows of ``embed_tokens``/``lm_head`` :meth:`fingerprint` covers (None: all), e.g.
    ``cfg.vocab_size`` for an engine that follows a directory of refit files, which hold the model's
    vocabulary without the padding rows (the trainer's anchor markers fingerprint those rows).
    ``tokenizer``: decodes completions for stop strings (``SamplingParams.stop``); None: they are refused.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        attn_implementation: str = "sdpa",
        init_seed: int = 0,
        tp: int = 1,
        gen_group: Any = None,
        vocab_rows: Optional[int] = None,
        tokenizer: Any = None,
    ) -> None:
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={attn_implementation!r}: choose sdpa or eager")
        self.cfg = cfg
        self.gen_group = gen_group
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = dtype
        self.hf_config = hf_config_from_model_config(cfg, tp)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(init_seed)  # CPU only: the model is initialised on the CPU
            model = AutoModelForCausalLM.from_config(
                self.hf_config, dtype=dtype, attn_implementation=attn_implementation
            )
        self.model = model.to(self.device).eval()
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache`` (old name deprecated): use whichever exists.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.vocab_size = int(self.hf_config.vocab_size)
        if cfg.vocab_size < self.vocab_size:  # the padded columns the trainer masks too
            mask_padded_vocab(self.model.get_output_embeddings(), cfg.vocab_size)
        self.max_positions = int(self.hf_config.max_position_embeddings)
        if vocab_rows is not None and (isinstance(vocab_rows, bool) or not isinstance(vocab_rows, int)
                                       or not 1 <= vocab_rows <= self.vocab_size):
            raise ValueError(f"vocab_rows={vocab_rows!r} must be an int in [1, {self.vocab_size}] (the rows of "
                             "embed_tokens/lm_head the fingerprint covers)")
        self.vocab_rows = vocab_rows
        self._version = 0
        self._projections = None  # sync.apply.ProjectionCache: sign(A) kept while the projection is unchanged
        logger.info(
            "embedded engine: %s, %d params, %s on %s",
            type(self.model).__name__, sum(p.numel() for p in self.model.parameters()), dtype, self.device,
        )

    # ------------------------------------------------------------------ weights (the rest: EmbeddedWeights)

    @property
    def weight_version(self) -> int:
        """Version of the loaded weights (0 = initial random weights)."""
        return self._version

"""Generation and scoring of the embedded rollout engine (:class:`EmbeddedGeneration`).

:class:`~megatron_logra.rollout.embedded.EmbeddedEngine` takes these methods from this mixin.
``generate`` left-pads the batch, runs each distinct prompt once, then decodes one token per step
through the KV cache, sampling with :func:`~megatron_logra.rollout.sampling.sample_next` from one
generator seeded with ``SamplingParams.seed``, and ends a sequence at a stop token or at the token that completes a
stop string (:class:`~megatron_logra.rollout.stop_strings.StopStrings`, which decodes with the engine's
``tokenizer``); ``logprobs_of`` scores given sequences with the same
log-prob convention from one full forward. See :mod:`megatron_logra.rollout.embedded` for the
conventions both keep.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.rollout.driver import share_from_driver
from megatron_logra.rollout.engine import Rollout, SamplingParams
from megatron_logra.rollout.sampling import sample_next
from megatron_logra.rollout.stop_strings import StopStrings

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedGeneration"]

_PAD_ID = 0  # any valid id: padded positions are masked out and never attended to


class EmbeddedGeneration:
    """The generation side of :class:`~megatron_logra.rollout.embedded.EmbeddedEngine` (a mixin: the
    engine sets ``cfg``, ``model``, ``device``, ``gen_group``, ``max_positions``, ``tokenizer``, ``_cache_kw`` and
    ``_version`` in its constructor)."""

    cfg: ModelConfig
    model: Any
    device: Any
    gen_group: Optional[Any]
    max_positions: int
    tokenizer: Any
    """Decodes completions for ``SamplingParams.stop`` (None: a call with stop strings is a ValueError)."""
    _cache_kw: str
    _version: int

    def _check_ids(self, seqs: list[list[int]], what: str) -> None:
        if not seqs:
            raise ValueError(f"{what}: empty batch")
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise ValueError(f"{what} {i} is empty")
            if min(s) < 0 or max(s) >= self.cfg.vocab_size:  # the padded ids [vocab_size, padded) are no tokens
                raise ValueError(f"{what} {i} has token ids outside [0, model.vocab_size={self.cfg.vocab_size})")

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [B, L], attention_mask [B, L], position_ids [B, L])`` of the left-padded batch."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), _PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        return ids.to(self.device), mask.to(self.device), positions.to(self.device)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """Sample one completion per prompt (batched, KV-cached). See the module docstring.

        With a ``gen_group`` (the trainer's model-parallel group) its rank 0 samples and the
        others receive its rollouts (:func:`~megatron_logra.rollout.driver.share_from_driver`): every
        rank of a model replica trains on the same rollouts even where GPU kernels are not bitwise
        reproducible across devices. Every rank of the group must call.

        Raises ``ValueError`` when a prompt is empty, holds ids outside the vocabulary, or is
        longer than ``max_position_embeddings - max_new_tokens + 1``: the last sampled token is never
        fed back, so a prompt of P tokens runs the model on at most ``P + max_new_tokens - 1`` positions
        (the trainer's bound too: a rollout of ``model.seq_length + 1`` tokens trains on ``seq_length``).
        """
        return share_from_driver(lambda: self._generate(prompts, params), self.gen_group)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        self._check_ids(prompts, "prompt")
        limit = self.max_positions - params.max_new_tokens + 1  # the last sampled token is never fed back
        for i, p in enumerate(prompts):
            if len(p) > limit:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; at most max_position_embeddings {self.max_positions} - "
                    f"max_new_tokens {params.max_new_tokens} + 1 = {limit} fit"
                )
        strings = StopStrings(params.stop, getattr(self, "tokenizer", None)) if params.stop else None
        gen = torch.Generator(device=self.device).manual_seed(params.seed)
        stops = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        batch = len(prompts)
        ids, mask, positions = self._left_pad(prompts)
        # the prompt forward once per distinct prompt; each row then takes its prompt's logits and KV cache rows
        distinct: dict[tuple[int, ...], int] = {}
        rows: list[int] = []  # the first batch row of each distinct prompt
        inverse: list[int] = []  # each row's distinct prompt
        for i, p in enumerate(prompts):
            j = distinct.setdefault(tuple(p), len(rows))
            if j == len(rows):
                rows.append(i)
            inverse.append(j)
        repeated = len(rows) < batch
        if repeated:
            first = torch.tensor(rows, dtype=torch.long, device=self.device)
            ids, mask_in, positions_in = ids[first], mask[first], positions[first]
        else:
            mask_in, positions_in = mask, positions
        out = self.model(
            input_ids=ids, attention_mask=mask_in, position_ids=positions_in, use_cache=True, logits_to_keep=1
        )
        cache = self._cache_of(out)
        next_pos = positions[:, -1] + 1  # [B]
        logits = out.logits[:, -1].float()  # [B, V] ([distinct prompts, V] until expanded)
        if repeated:
            expand = torch.tensor(inverse, dtype=torch.long, device=self.device)
            cache.reorder_cache(expand)
            logits = logits[expand]
        tokens_out = torch.empty((batch, 0), dtype=torch.long, device=self.device)
        logps_out = torch.empty((batch, 0), dtype=torch.float32, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        hit_stop = torch.zeros(batch, dtype=torch.bool, device=self.device)
        ends: dict[int, int] = {}  # rows a stop string ended -> their completion length
        sampled: list[list[int]] = [[] for _ in range(batch)]  # each live row's tokens (stop strings only)
        for step in range(params.max_new_tokens):
            tokens, logps = sample_next(logits, params.temperature, params.top_p, gen)
            tokens_out = torch.cat([tokens_out, tokens[:, None]], dim=1)
            logps_out = torch.cat([logps_out, logps.float()[:, None]], dim=1)
            is_stop = torch.isin(tokens, stops) & ~done
            hit_stop |= is_stop
            done |= is_stop
            if strings is not None and self._end_at_stop_strings(strings, tokens, done, sampled, ends, step):
                hit_stop |= done  # the rows a stop string just ended finished too
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = self.model(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                use_cache=True, **{self._cache_kw: cache},
            )
            cache = self._cache_of(out)
            next_pos = next_pos + 1
            logits = out.logits[:, -1].float()
        return [self._rollout(prompts[i], tokens_out[i].tolist(), logps_out[i].tolist(), stops, bool(hit_stop[i]),
                              ends.get(i)) for i in range(batch)]

    def _end_at_stop_strings(self, strings: StopStrings, tokens: torch.Tensor, done: torch.Tensor,
                             sampled: list[list[int]], ends: dict[int, int], step: int) -> bool:
        """Append this step's ``tokens`` to each live row's ``sampled`` ids and mark ``done`` (in place) the rows
        whose new token completes a stop string, recording their length (``step + 1``) in ``ends``. Returns
        whether any row ended here."""
        ended = []
        for i, (token, live) in enumerate(zip(tokens.tolist(), (~done).tolist())):
            if live:
                sampled[i].append(token)
                if strings.ends(sampled[i]):
                    ends[i] = step + 1
                    ended.append(i)
        if ended:
            done[torch.tensor(ended, dtype=torch.long, device=done.device)] = True
        return bool(ended)

    def _cache_of(self, out: Any) -> Any:
        """The KV cache (a transformers ``DynamicCache``) returned by a forward."""
        return out.cache if self._cache_kw == "cache" else out.past_key_values

    def _rollout(self, prompt: list[int], toks: list[int], logps: list[float], stops: torch.Tensor,
                 finished: bool, end: Optional[int] = None) -> Rollout:
        """Cut a row's tokens after its first stop token, or after the ``end`` tokens a stop string ended it at
        (later steps ran on for other rows only)."""
        stop_set = set(stops.tolist())
        n = end if end is not None else next((j + 1 for j, t in enumerate(toks) if t in stop_set), len(toks))
        return Rollout(list(prompt), toks[:n], logps[:n], finished, self._version)

    @torch.inference_mode()
    def logprobs_of(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0
    ) -> list[list[float]]:
        """Log-probs of each sequence's completion tokens ``seq[prompt_len:]`` from one full forward (no cache).

        Same convention as ``generate``: ``log_softmax(z / T)`` (``T == 0`` means T = 1). The batch is
        right-padded (causal attention: padding after a sequence cannot affect it). The last token of the
        batch is not run through the model (nothing follows it), so a sequence may hold
        ``max_position_embeddings + 1`` tokens, as a rollout of a prompt at ``generate``'s limit does.
        Returns one list of ``len(seq) - prompt_len`` floats per sequence.
        """
        self._check_ids(sequences, "sequence")
        if len(prompt_lens) != len(sequences):
            raise ValueError(f"prompt_lens has {len(prompt_lens)} entries for {len(sequences)} sequences")
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature!r} must be >= 0")
        for i, (s, n) in enumerate(zip(sequences, prompt_lens)):
            if not 1 <= n <= len(s):
                raise ValueError(f"prompt_lens[{i}]={n} must be in [1, {len(s)}] (sequence {i} length)")
            if len(s) > self.max_positions + 1:
                raise ValueError(f"sequence {i} has {len(s)} tokens > max_position_embeddings {self.max_positions} + 1")
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), _PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        if width == 1:  # one-token sequences: no completion tokens to score
            return [[] for _ in sequences]
        ids, mask = ids.to(self.device), mask.to(self.device)
        # the logits of the batch's last position would score nothing: positions 0 .. W-2 only
        logits = self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=False).logits.float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # [B, W-1, V]
        token_logp = logp.gather(-1, ids[:, 1:, None])[..., 0]  # [B, W-1]: logp of token j+1
        return [token_logp[i, n - 1: len(s) - 1].tolist() for i, (s, n) in enumerate(zip(sequences, prompt_lens))]

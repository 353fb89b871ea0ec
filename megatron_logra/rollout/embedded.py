"""In-process rollout engine: a ``transformers`` causal LM with KV-cached, batched sampling.

The engine owns its own copy of the policy, built from
:func:`megatron_logra.models.hf.hf_config_from_model_config` (random init until
:meth:`EmbeddedEngine.update_weights_full`). ``generate`` left-pads the batch, passes an
attention mask and per-row position ids (``cumsum(mask) - 1``, so every prompt starts at
position 0 whatever its padding), runs the prompt once (once per distinct prompt: rows that repeat a
prompt, as a GRPO group does, copy its logits and KV cache), then decodes one token per step
through ``past_key_values``. Sampling (greedy, temperature, top-p, stop tokens) draws from one
``torch.Generator`` seeded with ``SamplingParams.seed``: the same prompts, params and weights
give the same rollouts (a different batch composition may give different draws).
Padded vocabulary columns (beyond ``ModelConfig.vocab_size``) get the logit
``models.gpt.PADDED_LOGIT`` on both sides (engine ``lm_head`` and megatron ``output_layer``), so they
are never sampled and rollout and trainer log-probs describe the same distribution.
Log-prob convention: see :mod:`megatron_logra.rollout.engine`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from megatron_logra.models.gpt import ModelConfig, mask_padded_vocab
from megatron_logra.models.hf import hf_config_from_model_config
from megatron_logra.rollout.driver import share_from_driver
from megatron_logra.rollout.engine import Rollout, SamplingParams
from megatron_logra.sync.engine import full_shape_problems, vocab_prefix_fits
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.layout import VOCAB_PARALLEL

from transformers import AutoModelForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedEngine", "sample_next"]

_PAD_ID = 0  # any valid id: padded positions are masked out and never attended to


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits`` ``[B, V]`` (fp32).

    Returns ``(tokens [B] int64, logprobs [B] fp32)``: ``logprobs`` are of ``softmax(z / T)``
    before top-p truncation (``softmax(z)`` when ``T == 0``, which takes the argmax, lowest id on ties).
    Top-p keeps, in descending probability order (stable: lower id first on ties), every token whose
    preceding mass is ``< top_p``; the most likely token is therefore always kept.
    """
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
        probs = sorted_logp.exp()
        keep = (probs.cumsum(dim=-1) - probs) < top_p
        keep[:, 0] = True
        nucleus = torch.where(keep, probs, torch.zeros_like(probs))
        choice = torch.multinomial(nucleus, 1, generator=generator)
        tokens = order.gather(-1, choice)[:, 0]
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def _mismatch(name: str, value: Any, param: torch.Tensor, vocab_rows: int) -> str:
    """Why ``value`` cannot be loaded into ``param`` (not a tensor, another shape), or "" when it can:
    the same shape, or (``embed_tokens``/``lm_head``) the model's ``vocab_rows`` rows or more without the
    padding rows, as the model's HF checkpoint and a directory refit file hold them."""
    if not isinstance(value, torch.Tensor):
        return f"not a tensor ({type(value).__name__})"
    got, have = tuple(value.shape), tuple(param.shape)
    if got != have and not vocab_prefix_fits(name, got, have, vocab_rows):
        return f"shape {got} != {have}"
    return ""


class EmbeddedEngine:
    """A real generator running a ``transformers`` copy of the policy in this process.

    ``cfg`` fixes the architecture (see :func:`hf_config_from_model_config`; unsupported
    configs raise ``ValueError``). ``dtype``/``device`` place the model; ``attn_implementation``
    is passed to transformers ("sdpa" or "eager"); ``init_seed`` makes the random initial
    weights reproducible without touching the global RNG; ``tp`` is the trainer's TP degree, which
    fixes the padded vocabulary (``cfg.padded_vocab_size(tp)``). ``weight_version`` starts at 0.
    ``vocab_rows``: the rows of ``embed_tokens``/``lm_head`` :meth:`fingerprint` covers (None: all), e.g.
    ``cfg.vocab_size`` for an engine that follows a directory of refit files, which hold the model's
    vocabulary without the padding rows (the trainer's anchor markers fingerprint those rows).
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
    ) -> None:
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={attn_implementation!r}: choose sdpa or eager")
        self.cfg = cfg
        self.gen_group = gen_group
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

    # ------------------------------------------------------------------ weights

    @property
    def weight_version(self) -> int:
        """Version of the loaded weights (0 = initial random weights)."""
        return self._version

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes :meth:`update_weights_full` requires (tied ``lm_head`` excluded)."""
        return {name: tuple(p.shape) for name, p in self.model.named_parameters()}

    @property
    def fingerprint_vocab_rows(self) -> Optional[int]:
        """The rows of ``embed_tokens``/``lm_head`` :meth:`fingerprint` covers (``vocab_rows``; None: all),
        which policy sync's drift check reads to fingerprint the trainer's same rows."""
        return self.vocab_rows

    def check_full_shapes(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Raise ``SyncError("shape")`` naming what keeps full tensors of these names and shapes from
        :meth:`update_weights_full`, without touching anything (what a directory transport's ``load_full``
        asks before it streams a file)."""
        problems = full_shape_problems(shapes, self.expected_shapes(), vocab_prefix=True,
                                       min_vocab_rows=self.cfg.vocab_size)
        if problems:
            raise SyncError("shape", f"the embedded engine cannot load these tensors ({len(problems)} problems, "
                                     f"e.g. {problems[:6]}; embed_tokens/lm_head need {self.cfg.vocab_size} to "
                                     f"{self.vocab_size} rows): nothing was loaded")

    def update_weights_full(self, hf_state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Copy every parameter from ``hf_state`` (HF names) and set ``weight_version = version``.

        ``hf_state`` is a mapping or a stream of ``(name, tensor)`` pairs (``rl.weights.iter_hf_params``,
        which never holds the whole model). ``version`` is any int >= 0: a reload may go back to an earlier
        version (a consumer of a delta directory whose trainer resumed from an earlier checkpoint reloads that
        checkpoint's anchor), as :class:`~megatron_logra.sync.engine.ModuleEngine`'s does.
        Values are cast to the engine's dtype and device. ``embed_tokens``/``lm_head`` may hold the model's
        vocabulary without the engine's padding rows (``model.vocab_size`` rows, as the model's HF checkpoint
        and a directory refit file do): they fill the first rows, the padding rows (masked out of the
        logits) stay as they were. Unknown, repeated or missing names,
        values that are not tensors and shape mismatches raise ``ValueError`` listing them. A mapping
        is checked whole before anything is copied (such a failure leaves the engine untouched); a
        stream is checked tensor by tensor and always consumed to its end (its producer may be running
        collectives). A copy that fails (out of memory on the engine's device, a meta tensor, ...)
        stops the copying; the rest of the stream is still consumed and a ``ValueError`` names that
        tensor. Any failure after some tensor was copied leaves ``weight_version = -1`` (unknown) until a
        full refit succeeds; a failure before the first copy keeps the weights and the version.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r} must be an int >= 0")
        params = dict(self.model.named_parameters())
        if isinstance(hf_state, Mapping):
            unknown = sorted(set(hf_state) - set(params))
            missing = sorted(set(params) - set(hf_state))
            if unknown or missing:
                raise ValueError(f"update_weights_full: unknown names {unknown}, missing names {missing}")
            bad = [f"{n}: {why}" for n, t in hf_state.items() if (why := _mismatch(n, t, params[n], self.cfg.vocab_size))]
            if bad:
                raise ValueError(f"update_weights_full: wrong values {bad}")
        errors: list[str] = []
        seen: set[str] = set()
        copied = 0
        with torch.no_grad():
            for name, tensor in (hf_state.items() if isinstance(hf_state, Mapping) else hf_state):
                what = "unknown" if name not in params else "repeated" if name in seen else \
                    _mismatch(name, tensor, params[name], self.cfg.vocab_size)
                if what:
                    errors.append(f"{name}: {what}")
                    continue
                seen.add(name)
                if errors:
                    continue  # consume the rest of the stream, copy nothing more
                try:
                    dst = params[name] if tensor.shape == params[name].shape else params[name][: tensor.shape[0]]
                    dst.copy_(tensor.to(device=self.device, dtype=self.dtype))
                except Exception as exc:  # noqa: BLE001 - reported below, after the stream is consumed
                    errors.append(f"{name}: copy failed ({type(exc).__name__}: {str(exc)[:200]})")
                    continue
                copied += 1
        missing = sorted(set(params) - seen)
        if errors or missing:
            if copied:
                self._version = -1
            raise ValueError(f"update_weights_full: {errors[:8]} missing names {missing[:8]}"
                             f"{' (engine weights are partly replaced: weight_version = -1)' if copied else ''}")
        self._version = version
        logger.info("embedded engine: loaded %d tensors, weight_version=%d", len(seen), version)

    def apply_sketch_delta(self, delta) -> int:
        """Validate and apply one sketch delta (``SketchDelta`` or its encoded bytes) to the
        engine's weights; returns the new ``weight_version``. All-or-nothing: on any
        ``SyncError`` (checksum, version gap or replay, names, shapes, values) nothing changed."""
        from megatron_logra.sync.apply import ProjectionCache, apply_delta_
        from megatron_logra.sync.engine import as_delta

        d = as_delta(delta)
        weights = {name: p.data for name, p in self.model.named_parameters()}
        if self._projections is None:
            self._projections = ProjectionCache()
        self._version = apply_delta_(weights, d, self._version, layout="hf", tp_size=1, tp_rank=0,
                                     cache=self._projections)
        return self._version

    def fingerprint(self, rows_per_tensor: int = 4) -> dict[str, str]:
        """Per-tensor hash of sampled rows (``megatron_logra.sync.fingerprint``) for drift checks, the rows
        salted with the engine's weight version (successive checks cover every row)."""
        from megatron_logra.sync import fingerprint

        rows = self.fingerprint_vocab_rows
        weights = {name: p.data[:rows] if rows is not None and name in VOCAB_PARALLEL else p.data
                   for name, p in self.model.named_parameters()}
        return fingerprint(weights, rows_per_tensor, salt=self._version)

    # ------------------------------------------------------------------ generation

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
        for step in range(params.max_new_tokens):
            tokens, logps = sample_next(logits, params.temperature, params.top_p, gen)
            tokens_out = torch.cat([tokens_out, tokens[:, None]], dim=1)
            logps_out = torch.cat([logps_out, logps.float()[:, None]], dim=1)
            is_stop = torch.isin(tokens, stops) & ~done
            hit_stop |= is_stop
            done |= is_stop
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
        return [self._rollout(prompts[i], tokens_out[i].tolist(), logps_out[i].tolist(), stops, bool(hit_stop[i]))
                for i in range(batch)]

    def _cache_of(self, out: Any) -> Any:
        """The KV cache (a transformers ``DynamicCache``) returned by a forward."""
        return out.cache if self._cache_kw == "cache" else out.past_key_values

    def _rollout(self, prompt: list[int], toks: list[int], logps: list[float], stops: torch.Tensor,
                 finished: bool) -> Rollout:
        """Cut a row's tokens after its first stop token (later steps ran on for other rows only)."""
        stop_set = set(stops.tolist())
        n = next((j + 1 for j, t in enumerate(toks) if t in stop_set), len(toks))
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

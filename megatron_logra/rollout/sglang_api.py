"""SGLang's native ``/generate`` API as pure functions, and the log-prob convention checks.

Request (``POST /generate``; ``sglang.Engine.generate`` takes the same fields as keyword arguments)::

    {"input_ids": [[1, 5, 9], ...], "sampling_params": {"temperature": 1.0, "top_p": 1.0,
     "max_new_tokens": 32, "stop_token_ids": [2], "stop": ["</answer>"], ...}, "return_logprob": true}

Response: one dict per prompt, in order (a bare dict for a single prompt)::

    {"output_ids": [17, 4, 2],
     "meta_info": {"output_token_logprobs": [[-0.71, 17, null], [-1.2, 4, null], [-0.05, 2, null]],
                   "finish_reason": {"type": "stop", "matched": 2},   # or {"type": "length", "length": 3}
                   "weight_version": "3", "completion_tokens": 3, ...}}

(``output_token_logprobs`` entries are ``(logprob, token_id, text)`` tuples from the in-process
engine, JSON lists over HTTP; ``text`` is null without ``return_text_in_logprobs``.) The
log-prob semantics and why they match the trainer are in :mod:`megatron_logra.rollout.sglang_engine`; the
engine's start settings (``config.json``, context length, memory fraction, serialization) are in
:mod:`megatron_logra.rollout.sglang_engine_config` and importable from here. Imports no SGLang.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Sequence

from megatron_logra.rollout.engine import Rollout, SamplingParams
from megatron_logra.rollout.sglang_engine_config import (engine_context_length, engine_hf_config, resolve_serialization,
                                                         sglang_mem_fraction)

logger = logging.getLogger(__name__)

__all__ = ["build_generate_payload", "parse_generate_response", "check_logprob_convention", "check_engine_kwargs",
           "engine_hf_config", "engine_context_length", "sglang_mem_fraction", "resolve_serialization", "require_sglang", "request_seeds", "ORIGINAL_LOGPROB_ENV",
           "PADDED_LOGIT_BIAS", "SEED_LIMIT"]

PADDED_LOGIT_BIAS = -1.0e4  # models.gpt.PADDED_LOGIT, kept literal: this module must not import megatron
ORIGINAL_LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")
_warned_top_p = False
SEED_LIMIT = 2**31
"""Per-request ``sampling_seed``s lie in ``[0, SEED_LIMIT)``: SGLang's deterministic sampler holds them as int32."""
_MASK64 = 2**64 - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def require_sglang() -> Any:
    """``import sglang``, or an ImportError saying how to get it (GPU only)."""
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(
            "rl.rollout.engine='sglang' needs SGLang, which is not installed here "
            f"({exc}); install the GPU extra: pip install 'megatron-logra[sglang]' (CUDA only), "
            "or point rl.rollout.sglang_url at a running server, or use rl.rollout.engine=embedded") from exc
    return sglang


def check_engine_kwargs(kwargs: Mapping[str, Any], server_arg_names: Optional[set], version: str = "?") -> None:
    """Refuse ``sglang.Engine`` keyword arguments the installed SGLang's ``ServerArgs`` lacks (``ValueError``).

    ``sglang.Engine(**kwargs)`` builds ``ServerArgs(**kwargs)``, a dataclass: an unknown name fails there
    with a bare ``TypeError`` after the GPUs were checked. Older 0.5 releases lack
    ``enable_deterministic_inference`` (sent for ``rl.rollout.sglang_sampling_seed``), and a misspelt key in
    ``rl.rollout.sglang_engine_args`` fails the same way; this names them and the fix first.
    ``server_arg_names``: the field names of ``sglang.srt.server_args.ServerArgs`` (None: not known, no check).
    """
    if server_arg_names is None:
        return
    unknown = sorted(k for k in kwargs if k not in server_arg_names)
    if not unknown:
        return
    hints = []
    if "enable_deterministic_inference" in unknown:
        hints.append("enable_deterministic_inference comes from rl.rollout.sglang_sampling_seed=true and needs an "
                     "SGLang with deterministic inference (per-request sampling_seed); upgrade SGLang or set "
                     "rl.rollout.sglang_sampling_seed=false")
    raise ValueError(f"the installed SGLang ({version}) has no server argument(s) {unknown}: check "
                     f"rl.rollout.sglang_engine_args" + (f"; {'; '.join(hints)}" if hints else ""))


# --------------------------------------------------------------------------- pure translations


def check_logprob_convention(params: SamplingParams, env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse settings under which SGLang's log-probs are not ``log_softmax(z / T)`` (module docstring)."""
    global _warned_top_p
    env = os.environ if env is None else env
    for name in ORIGINAL_LOGPROB_ENV:
        if str(env.get(name, "")).lower() in ("1", "true", "yes", "on") and params.temperature not in (0, 1):
            raise ValueError(f"{name} is set: SGLang would return log-probs of softmax(z), not softmax(z/T) at "
                             f"T={params.temperature}; unset it")
    if params.top_p < 1 and params.temperature > 0 and not _warned_top_p:
        _warned_top_p = True
        logger.warning("sglang engine: top_p=%s < 1: depending on its version and sampling backend, SGLang may "
                       "report log-probs renormalised over the nucleus (>= the trainer's untruncated ones); the "
                       "mismatch metric shows it and importance weights absorb the gap", params.top_p)


def build_generate_payload(prompts: Sequence[Sequence[int]], params: SamplingParams, *, vocab_size: int,
                           padded_vocab_size: int, send_seed: bool = False,
                           engine_vocab_size: Optional[int] = None) -> dict:
    """The ``/generate`` body (also ``Engine.generate``'s keyword arguments) for one batch.

    ``temperature == 0`` is sent as 0 (SGLang maps it to greedy, ``top_k = 1``, log-probs of
    ``softmax(z)``). ``logit_bias`` holds the padded ids the engine's model has, ``[vocab_size,
    engine_vocab_size)`` (``engine_vocab_size``: the served model's ``vocab_size``, default
    ``padded_vocab_size``): SGLang's ``SamplingParams.verify`` refuses the whole request for a key
    outside ``[0, engine_vocab_size)``, and ids the engine does not have cannot be drawn anyway.
    ``send_seed`` adds ``sampling_seed = request_seeds(params.seed, len(prompts))[i]`` per prompt
    (SGLang's per-request seed), making ``sampling_params`` a list; otherwise SGLang samples from its
    own generator. Stop strings (``params.stop``) go as ``stop`` with ``no_stop_trim``: SGLang ends a request at
    the token whose decoded tail holds one, ``output_ids`` and their log-probs keep that token (as
    :class:`~megatron_logra.rollout.engine.SamplingParams` says; ``finish_reason`` is ``stop`` with the matched
    string), and its text keeps the string, as slime sends them. Without stop strings neither key is sent.
    """
    if not prompts:
        raise ValueError("generate: empty batch")
    sp: dict[str, Any] = {"temperature": float(params.temperature), "top_p": float(params.top_p),
                          "max_new_tokens": int(params.max_new_tokens),
                          "stop_token_ids": sorted(set(params.stop_token_ids)), "skip_special_tokens": False}
    if params.stop:  # the rollout keeps the tokens through the one completing the string: the text keeps it too
        sp["stop"] = list(params.stop)
        sp["no_stop_trim"] = True
    engine_vocab = padded_vocab_size if engine_vocab_size is None else min(engine_vocab_size, padded_vocab_size)
    if engine_vocab > vocab_size:
        sp["logit_bias"] = {str(i): PADDED_LOGIT_BIAS for i in range(vocab_size, engine_vocab)}
    sampling: Any = sp
    if send_seed:
        sampling = [{**sp, "sampling_seed": seed} for seed in request_seeds(params.seed, len(prompts))]
    return {"input_ids": [list(map(int, p)) for p in prompts], "sampling_params": sampling, "return_logprob": True}


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser: a bijection of 64-bit ints whose every output bit depends on every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def request_seeds(seed: int, n: int) -> list[int]:
    """The ``sampling_seed`` of each of ``n`` requests of one call whose ``SamplingParams.seed`` is ``seed``.

    Request ``i`` takes the ``i``-th output of a splitmix64 stream started at ``splitmix64(seed)``, cut to
    its top 31 bits: every seed lies in ``[0, SEED_LIMIT)`` (SGLang stores them as int32) whatever
    ``seed`` is, and the same ``(seed, n)`` always gives the same list. Calls whose ``seed`` differs (the
    RL loop's DP ranks and steps, which differ by small offsets) get unrelated streams, so their
    requests share a seed -- and SGLang's seeded Gumbel noise -- only by chance, as independent 31-bit
    draws would (about ``n_total**2 / 2**32`` pairs among ``n_total`` requests), never systematically.
    Within one call the seeds are distinct: a rare 31-bit repeat is replaced by the stream's next output.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"sampling.seed={seed!r} must be an int >= 0")
    state = _splitmix64(seed & _MASK64)
    seeds: list[int] = []
    used: set[int] = set()
    while len(seeds) < n:
        state = (state + _GOLDEN64) & _MASK64
        value = _splitmix64(state) >> 33
        if value not in used:
            used.add(value)
            seeds.append(value)
    return seeds


def parse_generate_response(response: Any, prompts: Sequence[Sequence[int]], weight_version: int,
                            stop_token_ids: Sequence[int] = ()) -> list[Rollout]:
    """Rollouts from a ``/generate`` answer (a list of per-prompt dicts; a bare dict for one prompt).

    ``completion_ids`` are ``output_ids`` (stop token included, as SGLang returns it); log-probs are the
    first field of each ``meta_info.output_token_logprobs`` entry, whose token id must equal the
    output id at that position; ``finished`` is ``finish_reason.type == "stop"`` or the last output id
    being one of ``stop_token_ids`` (the request's): SGLang checks the length cap before the stop ids,
    so a stop token drawn as the last allowed token reports ``length``, and the embedded engine calls
    that rollout finished. A ``weight_version``
    in ``meta_info`` that is an integer different from ``weight_version`` means the rollout came from
    other weights: ValueError. Any missing field or length mismatch is a ValueError naming it.
    """
    outs = [response] if isinstance(response, dict) else response
    stops = {int(t) for t in stop_token_ids}
    if not isinstance(outs, list) or len(outs) != len(prompts):
        raise ValueError(f"/generate returned {type(response).__name__} of "
                         f"{len(outs) if isinstance(outs, list) else '?'} items for {len(prompts)} prompts")
    rollouts = []
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        if not isinstance(out, dict) or "output_ids" not in out or not isinstance(out.get("meta_info"), dict):
            raise ValueError(f"/generate item {i} lacks output_ids or meta_info: {str(out)[:200]}")
        meta = out["meta_info"]
        ids = [int(t) for t in out["output_ids"]]
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise ValueError(f"/generate item {i} has no meta_info.output_token_logprobs (send return_logprob=True)")
        if len(entries) != len(ids):
            raise ValueError(f"/generate item {i}: {len(entries)} output_token_logprobs for {len(ids)} output_ids")
        logps = []
        for j, entry in enumerate(entries):
            logp, tok = entry[0], int(entry[1])
            if tok != ids[j] or logp is None:
                raise ValueError(f"/generate item {i} token {j}: logprob entry {entry!r} for output id {ids[j]}")
            logps.append(float(logp))
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind not in ("stop", "length"):
            raise ValueError(f"/generate item {i} finished with {reason!r} (expected stop or length)")
        tag = meta.get("weight_version")
        if tag is not None and str(tag).isdigit() and int(tag) != weight_version:
            raise ValueError(f"/generate item {i} was generated by weight_version {tag}, engine at {weight_version}")
        finished = kind == "stop" or (bool(ids) and ids[-1] in stops)
        rollouts.append(Rollout(list(prompt), ids, logps, finished, weight_version))
    return rollouts

"""The rollout engine's settings of the RL job (``rl.rollout``: :class:`RolloutConfig`), checked as they are made.

Which engine samples (the embedded transformers copy, or SGLang in process or at ``sglang_url``), how SGLang is
reached and started (API keys, timeout, serialization, memory share, TP size, seeds, engine arguments) and the
sampling of training and held-out rollouts, with their stop tokens and stop strings. An invalid value is a
``ValueError`` naming its ``rl.rollout.*`` field; an API key is never kept from a saved config (its ``"***"`` placeholder reads back as empty).
:func:`new_tokens_limit` is the one place that says how many tokens a training or held-out completion may have
(the evaluation's own ``eval_max_new_tokens``, or ``max_new_tokens``) and which field sets it.
Importable from :mod:`megatron_logra.rl.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_logra.rl.checks import check_finite_fields
from megatron_logra.rollout.sglang_setup import REDACTED_API_KEY

__all__ = ["EVAL_MAX_NEW_TOKENS_FIELD", "MAX_NEW_TOKENS_FIELD", "RolloutConfig", "check_stop_token_ids",
           "eval_new_tokens", "new_tokens_limit"]

MAX_NEW_TOKENS_FIELD = "rl.rollout.max_new_tokens"
EVAL_MAX_NEW_TOKENS_FIELD = "rl.rollout.eval_max_new_tokens"


@dataclass
class RolloutConfig:
    """Sampling of the rollout engine."""

    engine: str = "embedded"
    """``embedded`` (a transformers copy of the policy in this process; CPU recipes) or ``sglang``
    (``megatron_logra.rollout.sglang_engine``: an in-process ``sglang.Engine`` per DP replica, or the
    server at ``sglang_url``; GPU only)."""
    sglang_url: str = ""
    """Base URL of a running SGLang server (started with ``--custom-weight-loader
    megatron_logra.sync.sglang_loader.sync_loader``); empty: start an in-process ``sglang.Engine``."""
    sglang_api_key: str = ""
    """The server's ``--api-key`` (sent as a bearer token); empty: the environment variable ``SGLANG_API_KEY``,
    or none when that is unset too. Never written to disk: saved configs (``RUN/config.yaml``, checkpoints)
    hold ``"***"`` instead, and ``"***"`` read back (``train --resume RUN``) counts as empty, so a resumed
    run takes the key from ``SGLANG_API_KEY`` or from ``rl.rollout.sglang_api_key=...`` given again."""
    sglang_admin_api_key: str = ""
    """The server's ``--admin-api-key`` (newer SGLang), sent instead of ``sglang_api_key`` on its weight routes
    (``update_weights_from_tensor``, ``get_weights_by_name``, ``update_weight_version``), which with both keys
    set take only this one; empty: the environment variable ``SGLANG_ADMIN_API_KEY``, or none. Kept off disk
    like ``sglang_api_key``."""
    sglang_timeout: float = 600.0
    """Seconds each HTTP request to the server may take (generation and weight updates)."""
    sglang_serialization: str = "auto"
    """How dense tensors travel to a server: ``pickle`` (by value, base64 in JSON, once per server TP
    rank: any host, but a 27B refit is hundreds of GB of JSON), ``cuda_ipc`` (CUDA IPC handles: a
    server on the same host whose ``CUDA_VISIBLE_DEVICES`` includes the trainer's GPUs; its schedulers open
    CUDA contexts there) or ``auto`` (``pickle``: whether a server sees the trainer's GPUs cannot be told
    from its URL or arguments, ``rollout.sglang_api.resolve_serialization``)."""
    mem_fraction_static: float = 0.3
    """Share of each GPU's memory the in-process SGLang engine reserves for itself (weights + KV cache);
    the trainer lives in the rest (``megatron-logra memory --engine-fraction`` plans it). SGLang's own
    ``mem_fraction_static`` is a fraction of the memory free when the engine starts, so the engine is
    given ``share * total / free`` (``rollout.sglang_api.sglang_mem_fraction``)."""
    sglang_tp: int = 0
    """Tensor-parallel size of the in-process engine; 0 = the trainer's ``parallel.tp`` (its GPUs). Its GPUs
    ``[current device, + sglang_tp)`` must exist and be this DP replica's own (checked when the engine is built:
    ``rollout.sglang_setup.check_engine_gpus``)."""
    sglang_sampling_seed: bool = False
    """Send a per-request ``sampling_seed`` (reproducible rollouts on SGLang versions that support it).
    Request ``i`` of a call takes the ``i``-th output of a splitmix64 stream seeded with the call's sampling
    seed, cut to 31 bits (``rollout.sglang_api.request_seeds``): seeds fit SGLang's int32, are distinct within
    a call, and those of different DP ranks and steps coincide only by chance, never systematically.
    SGLang honours it only in deterministic mode: the in-process engine is started with
    ``enable_deterministic_inference=True`` (it needs a deterministic attention backend such as
    ``flashinfer``, ``fa3`` or ``triton``); a server must be started with
    ``--enable-deterministic-inference`` (a warning says when it was not). Off: SGLang samples from
    its own generator (seeded once with ``train.seed``)."""
    sglang_engine_args: dict = field(default_factory=dict)
    """Extra ``sglang.Engine`` keyword arguments (ServerArgs), e.g. ``{"attention_backend": "triton"}``."""
    temperature: float = 1.0
    """Sampling temperature τ (also the temperature of trainer log-probs and the KL probe)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 8
    """Completion length cap."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's end-of-sequence ids (its EOS and the
    ``generation_config.json``'s ``eos_token_id``), as slime's ``--rollout-stop-token-ids``: for training and
    held-out rollouts, on either engine. A stop token is kept in the completion and its log-probs, as EOS is,
    and left out of the text the reward scores, as EOS is. Each must be an id of the tokenizer and of
    ``model.vocab_size`` (checked when the run is built)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (non-empty), as slime's ``--rollout-stop``: a completion ends at the token whose decoded text
    completes one of them, for training and held-out rollouts. That token is kept with the ones before it (the
    token ids, their log-probs and the text the reward sees, which holds the stop string, all agree); on the
    embedded engine the match is on the reward's decoding of the completion's last tokens (``rollout.stop_strings``),
    SGLang matches on its own decoding, so it needs a tokenizer: a server's, or for the in-process engine
    ``sglang_engine_args`` ``skip_tokenizer_init: false`` and ``tokenizer_path`` (refused otherwise)."""
    eval_temperature: float = 0.0
    """Temperature of held-out evaluation (0 = greedy)."""
    eval_top_p: float = 1.0
    """Nucleus sampling mass of held-out evaluation (slime's ``--eval-top-p``); no effect when greedy."""
    eval_samples: int = 1
    """Samples per held-out problem; accuracy is their mean (mean@k, "pass@1 over k samples"), and above 1 the
    records also hold ``eval_pass_at_k`` (the share of problems with a correct one among the k)."""
    eval_max_new_tokens: int = 0
    """Completion length cap of held-out evaluation (slime's ``--eval-max-response-len``); 0 = ``max_new_tokens``.
    A held-out prompt must leave room for it within ``model.seq_length`` (training prompts for ``max_new_tokens``),
    so evaluating longer answers than training generates may need a longer ``model.seq_length``."""

    def __post_init__(self) -> None:
        check_finite_fields("rl.rollout", self)
        for key_field, env in (("sglang_api_key", "SGLANG_API_KEY"), ("sglang_admin_api_key", "SGLANG_ADMIN_API_KEY")):
            if not isinstance(getattr(self, key_field), str):
                raise ValueError(f"rl.rollout.{key_field} must be a string (or empty: the {env} variable)")
            if getattr(self, key_field) == REDACTED_API_KEY:  # a saved config's placeholder, not a key
                setattr(self, key_field, "")
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"rl.rollout.engine={self.engine!r}: choose embedded or sglang")
        if self.sglang_url and self.engine != "sglang":
            raise ValueError(f"rl.rollout.sglang_url={self.sglang_url!r} needs rl.rollout.engine=sglang")
        if self.sglang_url and not self.sglang_url.startswith(("http://", "https://")):
            raise ValueError(f"rl.rollout.sglang_url={self.sglang_url!r} must start with http:// or https://")
        if not self.sglang_timeout > 0:
            raise ValueError(f"rl.rollout.sglang_timeout={self.sglang_timeout} must be > 0")
        if self.sglang_serialization not in ("auto", "pickle", "cuda_ipc"):
            raise ValueError(f"rl.rollout.sglang_serialization={self.sglang_serialization!r}: "
                             "choose auto, pickle or cuda_ipc")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"rl.rollout.mem_fraction_static={self.mem_fraction_static} must lie in (0, 1)")
        if isinstance(self.sglang_tp, bool) or not isinstance(self.sglang_tp, int) or self.sglang_tp < 0:
            raise ValueError(f"rl.rollout.sglang_tp={self.sglang_tp!r} must be an int >= 0 (0 = parallel.tp)")
        if not isinstance(self.sglang_engine_args, dict):
            raise ValueError(f"rl.rollout.sglang_engine_args must be a mapping, got {self.sglang_engine_args!r}")
        if self.temperature <= 0:
            raise ValueError(f"rl.rollout.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rl.rollout.top_p={self.top_p} must lie in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"rl.rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        _check_stops(self)
        if not _is_fraction(self.eval_top_p):
            raise ValueError(f"rl.rollout.eval_top_p={self.eval_top_p!r} must lie in (0, 1] (1 = no nucleus cut)")
        if self.eval_temperature < 0:
            raise ValueError(f"rl.rollout.eval_temperature={self.eval_temperature} must be >= 0")
        if self.eval_samples < 1:
            raise ValueError(f"rl.rollout.eval_samples={self.eval_samples} must be >= 1")
        if isinstance(self.eval_max_new_tokens, bool) or not isinstance(self.eval_max_new_tokens, int) \
                or self.eval_max_new_tokens < 0:
            raise ValueError(f"rl.rollout.eval_max_new_tokens={self.eval_max_new_tokens!r} must be an int >= 0 "
                             "(0 = rl.rollout.max_new_tokens)")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError("rl.rollout.eval_samples > 1 needs rl.rollout.eval_temperature > 0 (greedy samples are identical)")


def eval_new_tokens(rollout: RolloutConfig) -> int:
    """The most tokens a held-out evaluation generates per completion: ``rl.rollout.eval_max_new_tokens``, or
    ``rl.rollout.max_new_tokens`` when that is 0 (the default: evaluation generates as training does)."""
    return new_tokens_limit(rollout, held_out=True)[0]


def new_tokens_limit(rollout: RolloutConfig, *, held_out: bool = False) -> tuple[int, str]:
    """``(tokens, field)``: the completion length cap of training rollouts (``held_out=False``) or of the held-out
    evaluation, and the field that sets it, for the messages that name the fix: the evaluation's is
    ``rl.rollout.eval_max_new_tokens`` only where that is set, so that a config without it reads as before."""
    if held_out and rollout.eval_max_new_tokens:
        return rollout.eval_max_new_tokens, EVAL_MAX_NEW_TOKENS_FIELD
    return rollout.max_new_tokens, MAX_NEW_TOKENS_FIELD


def _check_stops(rollout: RolloutConfig) -> None:
    """``stop_token_ids``: non-negative ints (the vocabulary is checked when the tokenizer is known:
    :func:`check_stop_token_ids`); ``stop``: non-empty strings, refused on the in-process SGLang engine unless
    ``sglang_engine_args`` load a tokenizer (``skip_tokenizer_init: false`` and a ``tokenizer_path``): without one
    SGLang cannot match them."""
    ids = rollout.stop_token_ids
    if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"rl.rollout.stop_token_ids={ids!r} must be a list of token ids (ints >= 0), e.g. "
                         "rl.rollout.stop_token_ids=[151645] or --rollout-stop-token-ids 151645 151643")
    rollout.stop_token_ids = list(ids)
    if not isinstance(rollout.stop, (list, tuple)) or any(not isinstance(t, str) or not t for t in rollout.stop):
        raise ValueError(f"rl.rollout.stop={rollout.stop!r} must be a list of non-empty strings, e.g. "
                         "--rollout-stop '</answer>'; drop the empty ones")
    rollout.stop = list(rollout.stop)
    args = rollout.sglang_engine_args if isinstance(rollout.sglang_engine_args, dict) else {}
    if (rollout.stop and rollout.engine == "sglang" and not rollout.sglang_url
            and (args.get("skip_tokenizer_init", True) or not args.get("tokenizer_path"))):
        raise ValueError(f"rl.rollout.stop={rollout.stop!r} (--rollout-stop): the in-process SGLang engine starts "
                         "without a tokenizer (skip_tokenizer_init, a model directory of config.json only), so it "
                         "cannot decode completions to match stop strings and refuses every request that has them; "
                         "end completions by token instead (rl.rollout.stop_token_ids, --rollout-stop-token-ids), or "
                         'give it a tokenizer: rl.rollout.sglang_engine_args=\'{"skip_tokenizer_init": false, '
                         '"tokenizer_path": "DIR"}\', or use a server started with its tokenizer (rl.rollout.sglang_url) '
                         'or rl.rollout.engine=embedded')


def check_stop_token_ids(rollout: RolloutConfig, vocab_size: int, what: str) -> None:
    """Refuse a ``rl.rollout.stop_token_ids`` entry outside ``[0, vocab_size)`` (``what``: whose vocabulary, for
    the message, e.g. ``"the tokenizer (146 tokens) and model.vocab_size=160"``)."""
    bad = [t for t in rollout.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"rl.rollout.stop_token_ids has {bad}, outside {what} (ids 0 .. {vocab_size - 1}): give "
                         "ids of this run's tokenizer")


def _is_fraction(value: object) -> bool:
    """A number in (0, 1] (bools, NaN and strings are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1

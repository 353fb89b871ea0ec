"""The rollout-engine interface the RL loop uses: sampling parameters, rollouts, the engine protocol.

Log-prob convention (every engine): ``Rollout.logprobs[j]`` is the log-probability of
``completion_ids[j]`` under the temperature-scaled distribution ``softmax(z / T)`` of the policy
that sampled it, taken BEFORE top-p truncation (the nucleus only restricts which tokens can be
drawn; it does not renormalise the reported log-prob). With ``T = 0`` (greedy) the distribution
``softmax(z / 0)`` is degenerate, so greedy rollouts report log-probs under ``softmax(z)`` (T = 1).
These are the numbers the trainer compares with its own ``log_softmax(z / T)`` for importance
weights and the rollout/trainer mismatch.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Union, runtime_checkable

import torch

logger = logging.getLogger(__name__)

__all__ = ["SamplingParams", "Rollout", "RolloutEngine"]


def _is_int(value: object) -> bool:
    """An integer of any integral type (``int``, ``numpy.int64``, ...), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A real number of any type (``float``, ``int``, ``numpy.float32``, ...), but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to sample completions for one ``generate`` call.

    Numbers may be of any integral / real type (``numpy.int64`` included, bools excluded) and are stored as
    Python ``int`` / ``float``; a value of the wrong kind is a ``ValueError`` naming ``sampling.<field>``.
    """

    temperature: float = 1.0
    """Softmax temperature T >= 0; 0 means greedy (argmax, ties to the lowest token id)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: sample from the smallest set of most likely tokens whose mass reaches top_p."""
    max_new_tokens: int = 32
    """Completion length limit (>= 1); a sequence cut here has ``finished=False``."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sequence; the stop token is included in ``completion_ids``."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (non-empty): a sequence ends at the token whose decoded text completes one of them; that
    token and those before it are kept (``completion_ids``, ``logprobs``), with ``finished=True``. Text after
    the stop string within that last token is kept too: the completion is always whole tokens."""
    seed: int = 0
    """Seed of the sampling generator: the same prompts and params give the same rollouts."""

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"sampling.temperature={self.temperature!r} must be a finite number >= 0")
        self.temperature = float(self.temperature)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p!r} must be in (0, 1]")
        self.top_p = float(self.top_p)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        self.max_new_tokens = int(self.max_new_tokens)
        try:
            stops = list(self.stop_token_ids)
        except TypeError:
            stops = None
        if stops is None or isinstance(self.stop_token_ids, (str, bytes)) or \
                any(not _is_int(t) or t < 0 for t in stops):
            raise ValueError(f"sampling.stop_token_ids={self.stop_token_ids!r} must be a list of non-negative ints "
                             "(an empty list: no stop tokens)")
        self.stop_token_ids = [int(t) for t in stops]
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, (list, tuple)) or \
                any(not isinstance(text, str) or not text for text in self.stop):
            raise ValueError(f"sampling.stop={self.stop!r} must be a list of non-empty strings (an empty list: no "
                             "stop strings)")
        self.stop = list(self.stop)
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"sampling.seed={self.seed!r} must be an int in [0, 2**63)")
        self.seed = int(self.seed)


@dataclass
class Rollout:
    """One sampled completion."""

    prompt_ids: list[int]
    """The prompt's token ids, as given."""
    completion_ids: list[int]
    """Generated token ids (including the stop token when one ended the sequence)."""
    logprobs: list[float]
    """Per completion token: log-prob under softmax(z/T) before top-p truncation (T=0: softmax(z))."""
    finished: bool
    """True when a stop token or stop string ended the sequence; False when ``max_new_tokens`` cut it."""
    weight_version: int
    """Version of the weights that produced every token of this rollout."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"rollout.logprobs has {len(self.logprobs)} entries for {len(self.completion_ids)} completion_ids"
            )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a generator (embedded torch engine, SGLang, ...)."""

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded (tags every rollout)."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """One rollout per prompt, in order, all from the same ``weight_version``."""
        ...

    def update_weights_full(self, hf_state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Replace every weight (HF names, full TP=1 layout) and set ``weight_version = version``.

        ``hf_state`` is a mapping or a stream of ``(name, tensor)`` pairs; a stream must be
        consumed to its end even on failure (the trainer produces it with collectives).
        """
        ...

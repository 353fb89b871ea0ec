"""Labels outside the logits' vocabulary are refused by the chunked log-prob functions.

Without the check, a label that no TP rank owns (HF's ignore index ``-100``, or an id of a larger
tokenizer) gets the log-prob of the row's argmax token. That value is finite and looks plausible,
and its gradient is wrong too. Labels in the padded range ``[vocab_size, V_padded)`` are real
columns: they stay accepted.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.models.gpt import PADDED_LOGIT
from megatron_logra.rl.logprobs import chunked_logprobs_and_entropy, chunked_token_logprobs, token_entropy

V, VP = 70, 80  # vocabulary and its padded size


def _logits():
    z = torch.randn(2, 5, VP, generator=torch.Generator().manual_seed(0)) * 3
    z[..., V:] = PADDED_LOGIT
    return z


@pytest.mark.parametrize("bad", [-100, -1, VP, 10**6])
@pytest.mark.parametrize("fn", [chunked_token_logprobs, chunked_logprobs_and_entropy])
@pytest.mark.parametrize("chunk", [0, 3])
def test_an_out_of_range_label_is_a_value_error_naming_it_and_the_vocabulary(fn, bad, chunk):
    labels = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(1))
    labels[1, 3] = bad
    with pytest.raises(ValueError, match=rf"labels: label {bad} is outside \[0, {VP}\).*\({VP} ids\)"):
        fn(_logits(), labels, 1.0, None, chunk)


def test_the_smallest_negative_label_is_named_first():
    labels = torch.tensor([[3, -100, VP + 5, -7, 1]] * 2)
    with pytest.raises(ValueError, match=r"label -100 is outside"):
        chunked_token_logprobs(_logits(), labels)


def test_labels_at_both_ends_of_the_padded_vocabulary_are_accepted_and_exact():
    z = _logits().requires_grad_(True)
    labels = torch.tensor([[0, VP - 1, V, V - 1, 5]] * 2)
    logp, ent = chunked_logprobs_and_entropy(z, labels, 0.7, None, 3)
    ref = torch.log_softmax(z.detach().double() / 0.7, -1)
    want = ref.gather(-1, labels[..., None])[..., 0]
    assert torch.allclose(logp.double(), want, atol=1e-5, rtol=1e-6)  # rtol: padded columns have |logp| ~ 1.4e4
    assert torch.allclose(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
    assert logp[0, 1] < -1e3 and logp[0, 2] < -1e3  # padded columns: masked, not refused
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(z.grad).all()


def test_entropy_alone_takes_no_labels():
    z = _logits()
    ref = torch.log_softmax(z.double(), -1)
    assert torch.allclose(token_entropy(z).double(), -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)


def test_empty_labels_pass_through():
    out = chunked_token_logprobs(torch.zeros(0, VP), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)

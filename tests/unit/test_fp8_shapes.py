"""The FP8 projection's shape contract, checked before ``torch._scaled_mm`` (CPU: a pure function)."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sketch.fp8 import check_fp8_shapes, fp8_projection


@pytest.mark.parametrize("n_in, rank", [(16, 16), (64, 128), (4096, 256)])
def test_multiples_of_16_pass(n_in, rank):
    assert check_fp8_shapes(n_in, rank) is None


def test_a_rank_not_a_multiple_of_16_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"sketch rank r \(optimizer\.logra\.rank, --rank\)=100 \(choose e\.g\. 96 or 112\)"):
        check_fp8_shapes(64, 100)


def test_an_input_width_not_a_multiple_of_16_is_refused_naming_the_width():
    with pytest.raises(ValueError, match=r"input width n_in .*--hidden\)=72 \(choose e\.g\. 64 or 80\)") as info:
        check_fp8_shapes(72, 16)
    assert "rank" not in str(info.value).split(":", 1)[1]


def test_both_wrong_and_below_16():
    with pytest.raises(ValueError, match=r"n_in .*=8 \(choose e\.g\. 16\); .*rank.*=4 \(choose e\.g\. 16\)"):
        check_fp8_shapes(8, 4)


def test_fp8_projection_checks_shapes_before_the_device():
    """A wrong rank is reported as such (not as torch._scaled_mm's or the CUDA check's error)."""
    sign = torch.ones(8, 64)
    with pytest.raises(ValueError, match=r"optimizer\.logra\.rank, --rank\)=8"):
        fp8_projection(torch.randn(4, 64), sign)
    with pytest.raises(ValueError, match=r"expected \[r, n_in\] with n_in = x\.shape\[-1\] = 64"):
        fp8_projection(torch.randn(4, 64), torch.ones(16, 32))

"""An independent reference of the merge's Rademacher product, for the bitwise tests.

The contract (``megatron_logra.sync.apply``): ``V = grid(s ⊙ U)`` (one fp32 product per entry, then
each row rounded half-to-even onto ``q_i = 2^(e_i + L − 24)``, ``2^(e_i−1) <= rowmax_i < 2^e_i``,
``L = ceil(log2 r)``, rows below ``2^-100`` zero) and ``P = V·sign(A)``, exact. Written here row by
row with Python's ``math.frexp`` and float64 arithmetic, sharing no code with the package.
"""

from __future__ import annotations

import math

import torch


def scaled_factor_reference(U: torch.Tensor, s: float) -> torch.Tensor:
    """``grid(s ⊙ U)`` as float64 ``[n_out, r]`` (every value is an fp32 value)."""
    r = U.shape[1]
    L = max(0, math.ceil(math.log2(r)))
    X = (U.double() * s).float().double()  # the exact product, rounded once to fp32
    rows = []
    for row in X.tolist():
        rowmax = max(abs(x) for x in row)
        if rowmax < 2.0**-100:
            rows.append([0.0] * r)
            continue
        _, e = math.frexp(rowmax)  # rowmax = m·2^e with 0.5 <= m < 1
        q = 2.0 ** (e + L - 24)
        rows.append([round(x / q) * q for x in row])  # Python's round is half-to-even
    return torch.tensor(rows, dtype=torch.float64).reshape(U.shape[0], r)


def rademacher_product_reference(U: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``P = grid(s ⊙ U)·sign(A)`` in fp32 for a Rademacher ``A`` (entries ±s), the sum taken in float64."""
    s = float(A.abs().flatten()[0])
    assert bool((A.abs() == s).all()), "not a Rademacher projection"
    exact = scaled_factor_reference(U, s) @ torch.sign(A.double())
    assert torch.equal(exact.float().double(), exact), "the product is not exact in fp32"
    return exact.float()

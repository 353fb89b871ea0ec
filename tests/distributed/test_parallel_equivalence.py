"""TP / PP / DP equivalence of LoGRA training (and dense AdamW) on megatron-core over gloo.

Every layout trains the same 4-layer GPT (hidden 64, 4 heads, ffn 128, SwiGLU, vocab 64; init is
layout-invariant) for 3 steps on the same global batch (8 sequences, micro-batch 2) with LoGRA
rank 8 (RowAdam, optimizer recipe, lr 1e-2, clip 1.0) and is compared with a 1-process run:

* per-step losses and grad norms,
* every target's sketch after ``prepare()`` at every step (TP-reduced, DP-summed, divided by the
  global token count), unsharded to the full layout and keyed by canonical name,
* the full weights after the last step (by global parameter name).

Tolerances (fp32 throughout; the layouts evaluate the same sums in a different order):

* PP=2 vs PP=1 splits no reduction, so it must be **bitwise** equal; so must recompute=full vs
  recompute=none at one layout (the recompute replays the same kernels, RNG states restored).
* TP and DP change summation order: TP splits the row-parallel inner products (``X·Aᵀ`` over
  ``n_in`` and ``Hᵀ·P``) into partial sums reduced over ranks; DP splits the token sum of the
  sketch over ranks. fp32 rounding of a length-K sum is ``γ_K ≈ K·2⁻²⁴`` of the sum of
  magnitudes; with K ≲ 400 (tokens per step + n_in) that is ≲ 3e-5 relative to the largest
  entry of a sketch (measured: ≤ 3e-6, including the weight differences of earlier steps). So
  sketches: ``|S − S_ref| ≤ 1e-4·|S_ref| + 1e-4·max|S_ref|`` per tensor (a wrong shard
  order, a missing TP or DP reduction or a wrong normalisation is an O(1) relative error).
* weights: ``atol = 1e-5`` (measured ≤ 1.2e-6 for LoGRA, ≤ 3e-6 for AdamW). The weights move by
  about ``lr = 1e-2`` per step; RowAdam's per-row and Adam's per-element normalisation by the
  gradient's own magnitude amplify rounding differences of near-zero rows/elements, so the bound
  is set at 1e-3 of one step's movement rather than at fp32 resolution of the weights.
* losses: ``rtol = 1e-5`` (measured ≤ 2e-7 relative); grad norms ``rtol = 1e-4`` (measured
  ≤ 2.5e-5 relative: the norm² is summed over sketch Grams and native grads in another order).

Launches are batched (several jobs per torchrun, see ``worker.py``) because each launch pays
6–9 s of imports on 2 cores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed

STEPS = 3
NUM_LAYERS = 4
TARGET_SUFFIXES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

SKETCH_RTOL = 1e-4
SKETCH_ATOL_REL = 1e-4  # × max |S_ref| of each sketch
WEIGHT_ATOL = 1e-5
LOSS_RTOL = 1e-5
GNORM_RTOL = 1e-4
DROPOUT_STEPS = 6


class Result:
    def __init__(self, out: Path, name: str):
        path = out / f"{name}.json"
        if not path.exists():
            log = (out / "launch.log").read_text()[-4000:] if (out / "launch.log").exists() else ""
            pytest.fail(f"job {name} produced no result in {out}\n{log}")
        self.name = name
        self.meta = json.loads(path.read_text())
        self.tensors = load_file(str(out / f"{name}.safetensors"))

    def group(self, prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    @property
    def losses(self) -> list[float]:
        return self.meta["losses"]


# --------------------------------------------------------------------------- launches (once per module)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, launcher):
    """1-process runs: LoGRA, LoGRA with full recompute, dense AdamW, one step with tied embeddings."""
    out = launcher.launch_worker(1, tmp_path_factory.mktemp("ref"), ["ref", "ref_rc:recompute=full", "adam:optimizer=adam",
                                                                     "ref_tie:tie=1,steps=1"])
    return {n: Result(out, n) for n in ("ref", "ref_rc", "adam", "ref_tie")}


@pytest.fixture(scope="module")
def two(tmp_path_factory, launcher):
    """2-process runs, one launch: TP2, PP2, DP2 (LoGRA), DP2 (AdamW), TP2 with recompute, dropout,
    one PP2 step with tied embeddings."""
    drop = f"tp=2,hidden_dropout=0.1,steps={DROPOUT_STEPS}"
    jobs = ["tp2:tp=2", "pp2:pp=2", "dp2", "adam_dp2:optimizer=adam", "tp2_rc:tp=2,recompute=full",
            f"tp2_drop:{drop}", f"tp2_drop_rc:{drop},recompute=full", "pp2_tie:pp=2,tie=1,steps=1"]
    out = launcher.launch_worker(2, tmp_path_factory.mktemp("two"), jobs, timeout=400)
    return lambda name: Result(out, name)


@pytest.fixture(scope="module")
def four(tmp_path_factory, launcher):
    """4-process run: TP2 × PP2."""
    out = launcher.launch_worker(4, tmp_path_factory.mktemp("four"), ["tp2pp2:tp=2,pp=2"], timeout=400)
    return Result(out, "tp2pp2")


# --------------------------------------------------------------------------- comparisons


def _expected_sketch_keys(steps: int = STEPS) -> set[str]:
    return {f"{s}/model.layers.{i}.{suffix}" for s in range(1, steps + 1) for i in range(NUM_LAYERS)
            for suffix in TARGET_SUFFIXES}


def assert_layout(res: Result, tp: int, pp: int, dp: int) -> None:
    m = res.meta
    assert (m["tp"], m["pp"], m["dp"]) == (tp, pp, dp), f"{res.name}: ran at tp={m['tp']} pp={m['pp']} dp={m['dp']}"
    assert not any(m["skipped"]), f"{res.name}: skipped steps {m['skipped']}"
    # replicas must be bitwise identical after the same reduced update
    assert m["dp_replica_max_diff"] == 0.0, f"{res.name}: DP replicas differ by {m['dp_replica_max_diff']}"
    assert m["tp_replica_max_diff"] == 0.0, f"{res.name}: TP-replicated params differ by {m['tp_replica_max_diff']}"


def assert_scalars_close(res: Result, ref: Result) -> None:
    assert len(res.losses) == len(ref.losses) == STEPS
    for key, rtol in (("losses", LOSS_RTOL), ("grad_norms", GNORM_RTOL)):
        for step, (a, b) in enumerate(zip(res.meta[key], ref.meta[key]), start=1):
            assert math.isfinite(a) and math.isclose(a, b, rel_tol=rtol, abs_tol=0.0), (
                f"{res.name} vs {ref.name}: {key} at step {step}: {a!r} vs {b!r}"
            )
    assert res.meta["tokens"] == ref.meta["tokens"], "global token counts differ: not the same global batch"


def assert_sketches_close(res: Result, ref: Result, *, exact: bool = False) -> None:
    got, want = res.group("sketch/"), ref.group("sketch/")
    assert set(want) == _expected_sketch_keys(), f"reference sketches: {sorted(want)[:6]}..."
    assert set(got) == set(want), f"{res.name}: missing {sorted(set(want) - set(got))[:4]}, extra {sorted(set(got) - set(want))[:4]}"
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape, f"{res.name}: sketch {key} has shape {tuple(g.shape)}, reference {tuple(w.shape)}"
        scale = float(w.abs().max())
        assert scale > 0, f"reference sketch {key} is all zeros: the comparison would be vacuous"
        if exact:
            assert torch.equal(g, w), f"{res.name}: sketch {key} differs (max {float((g - w).abs().max()):.3g}), expected bitwise"
        else:
            torch.testing.assert_close(g, w, rtol=SKETCH_RTOL, atol=SKETCH_ATOL_REL * scale,
                                       msg=lambda m, key=key: f"{res.name}: sketch {key}: {m}")


def assert_weights_close(res: Result, ref: Result, *, exact: bool = False) -> None:
    got, want, init = res.group("weight/"), ref.group("weight/"), ref.group("init/")
    assert set(got) == set(want), f"{res.name}: missing {sorted(set(want) - set(got))[:4]}, extra {sorted(set(got) - set(want))[:4]}"
    # the same start (layout-invariant init) ...
    for key, w0 in init.items():
        assert torch.equal(res.group("init/")[key], w0), f"{res.name}: initial {key} differs from the reference"
    moved = 0
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape, f"{res.name}: {key} has shape {tuple(g.shape)}, reference {tuple(w.shape)}"
        moved += int(not torch.equal(w, init[key]))
        if exact:
            assert torch.equal(g, w), f"{res.name}: {key} differs (max {float((g - w).abs().max()):.3g}), expected bitwise"
        else:
            torch.testing.assert_close(g, w, rtol=0.0, atol=WEIGHT_ATOL, msg=lambda m, key=key: f"{res.name}: {key}: {m}")
    # ... and training moved (nearly) every tensor, so equality is not vacuous
    assert moved >= len(want) - 1, f"only {moved}/{len(want)} parameters changed during training"


def assert_equivalent(res: Result, ref: Result, *, exact: bool = False) -> None:
    if exact:
        assert res.losses == ref.losses, f"{res.name}: losses {res.losses} vs {ref.losses}"
    assert_scalars_close(res, ref)
    if ref.group("sketch/"):
        assert_sketches_close(res, ref, exact=exact)
    assert_weights_close(res, ref, exact=exact)


# --------------------------------------------------------------------------- tests


def test_reference_trains(ref):
    r = ref["ref"]
    assert_layout(r, 1, 1, 1)
    assert all(math.isfinite(x) for x in r.losses)
    weights = r.group("weight/")
    # every target layer of every global layer is a LoGRA target; its sketches cover all steps
    assert set(r.group("sketch/")) == _expected_sketch_keys()
    for i in range(NUM_LAYERS):
        assert f"decoder.layers.{i}.mlp.linear_fc1.weight" in weights


def test_tp2_matches_tp1(two, ref):
    res = two("tp2")
    assert_layout(res, 2, 1, 1)
    assert_equivalent(res, ref["ref"])


def test_pp2_matches_pp1_bitwise(two, ref):
    res = two("pp2")
    assert_layout(res, 1, 2, 1)
    assert_equivalent(res, ref["ref"], exact=True)


def test_pp2_tied_embeddings_start_as_pp1(two, ref):
    # tied word embeddings at PP=2: the last stage's copy (output_layer.weight) is the first stage's
    # embedding, so the model is the PP=1 model and its first loss is the same, bit for bit
    res, base = two("pp2_tie"), ref["ref_tie"]
    assert_layout(res, 1, 2, 1)
    assert res.losses == base.losses, f"step-1 loss {res.losses} at PP=2 vs {base.losses} at PP=1 (tied embeddings)"
    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    want = base.group("init/")
    assert out not in want, "at PP=1 a tied model has no output_layer.weight"
    got = res.group("init/")
    assert set(got) == set(want) | {out}
    assert all(torch.equal(got[k], w) for k, w in want.items()), "PP=2 tied init differs from PP=1"
    # the copies are equal at the start and stay equal through an update (their grads are summed)
    for prefix in ("init/", "weight/"):
        w = res.group(prefix)
        assert torch.equal(w[out], w[emb]), f"{prefix}: last stage's output weight differs from the first stage's embedding"
    assert not torch.equal(res.group("weight/")[emb], got[emb]), "the tied embedding did not train"


def test_pp2_sketch_targets_are_agreed_over_stages(two):
    # install_sketches(pp_group=...): a target on one stage only is accepted by every stage, and a
    # refused target list raises the same ValueError on every rank (none raises alone and hangs the other)
    checks = two("pp2").meta["target_checks"]
    assert checks["output_layer"] == [[0, 0], [1, 1]], checks["output_layer"]  # the last stage holds it
    errors = {outcome for _, outcome in checks["linear_fc1,no_such_layer"]}
    assert len(errors) == 1 and "['no_such_layer'] match no module of the model (on any pipeline stage)" in errors.pop()
    tied = {outcome for _, outcome in two("pp2_tie").meta["target_checks"]["output_layer"]}
    assert len(tied) == 1, f"ranks disagree: {tied}"
    assert "pipeline stage 1: target 'output_layer'" in (msg := tied.pop()), msg
    assert "set model.untie_embeddings_and_output_weights=true or drop 'output_layer'" in msg, msg


def test_dp2_matches_dp1(two, ref):
    res = two("dp2")
    assert_layout(res, 1, 1, 2)
    assert res.meta["num_micro"] * 2 == ref["ref"].meta["num_micro"]
    assert_equivalent(res, ref["ref"])


def test_tp2_pp2_matches_single_process(four, ref):
    assert_layout(four, 2, 2, 1)
    assert_equivalent(four, ref["ref"])


def test_dense_adamw_dp2_matches_dp1(two, ref):
    res, base = two("adam_dp2"), ref["adam"]
    assert_layout(res, 1, 1, 2)
    assert_layout(base, 1, 1, 1)
    assert not base.group("sketch/") and not res.group("sketch/"), "dense AdamW has no sketches"
    assert_equivalent(res, base)


def test_full_recompute_equals_no_recompute(two, ref):
    # bitwise at TP=1 and at TP=2: recompute replays the same forward, sketches are added once
    assert_equivalent(ref["ref_rc"], ref["ref"], exact=True)
    res = two("tp2_rc")
    assert_layout(res, 2, 1, 1)
    assert_equivalent(res, two("tp2"), exact=True)


def test_dropout_with_full_recompute_under_tp2_trains(two, ref):
    drop, drop_rc = two("tp2_drop"), two("tp2_drop_rc")
    for res in (drop, drop_rc):
        assert_layout(res, 2, 1, 1)
        assert len(res.losses) == DROPOUT_STEPS and all(math.isfinite(x) for x in res.losses)
    # dropout is active: the first loss differs from the dropout-free run of the same batch
    assert drop_rc.losses[0] != ref["ref"].losses[0]
    # the recompute restores the RNG states of the first forward: the same masks, the same run
    assert drop_rc.losses == drop.losses, f"recompute changed the dropout run: {drop_rc.losses} vs {drop.losses}"
    assert torch.equal(torch.cat([v.flatten() for _, v in sorted(drop_rc.group('weight/').items())]),
                       torch.cat([v.flatten() for _, v in sorted(drop.group('weight/').items())]))
    # and it learns: the mean of the last 3 losses is well below the first
    first, last = drop_rc.losses[0], sum(drop_rc.losses[-3:]) / 3
    assert last < first - 0.5, f"loss did not decrease with dropout + recompute: {drop_rc.losses}"

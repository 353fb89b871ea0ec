"""A plan of Megatron's distributed optimizer is labelled as one at every DP size.

At DP 1 the sharded state equals the whole one, but the plan still differs: the fused step has neither
the foreach square roots nor the fp64 grad-norm copy. Both tables used to be headed plain "dense AdamW"
there, so two different totals carried one label and nothing in the output said which was which."""

from __future__ import annotations

from megatron_logra.memory.cli import main
from megatron_logra.memory.planner import plan
from megatron_logra.memory.units import format_bytes
from megatron_logra.models.presets import get_preset


def _qwen15b_tp2_counts() -> tuple[int, int]:
    """(16-bit, fp32) parameters of one TP-2 rank of Qwen2.5-1.5B, from its published shape."""
    h, a, g, d, f, V, L, t = 1536, 12, 2, 128, 8960, 151936, 28, 2
    qkv = (a + 2 * g) * d
    per_layer_16 = (qkv * h + qkv + h * a * d + 2 * f * h + f * h) // t
    n16 = L * per_layer_16 + V * h // t          # tied embedding, one copy at PP 1
    n32 = L * 2 * h + h                            # local-spec RMSNorm weights, replicated over TP
    return n16, n32


def _table(capsys, *extra) -> str:
    argv = ["--model", "qwen2.5-1.5b", "--tp", "2", "--dp", "1", "--compare", "--rank", "64", "--recompute", "full",
            "--seq-len", "512", "--markdown", *extra]
    assert main(argv) == 0
    return capsys.readouterr().out


def test_distributed_optimizer_at_dp1_is_labelled_and_differs_only_in_step_temporaries(capsys):
    n16, n32 = _qwen15b_tp2_counts()
    n = n16 + n32
    model = get_preset("qwen2.5-1.5b")
    whole = plan(model, tp=2, dp=1, optimizer="adam", recompute="full", seq_len=512).worst
    split = plan(model, tp=2, dp=1, optimizer="adam", recompute="full", seq_len=512,
                 distributed_optimizer=True).worst
    # same persistent state at DP 1: weights 2·N16 + 4·N32, grads 4·N, masters 4·N16, moments 8·N
    persistent = 2 * n16 + 4 * n32 + 4 * n + 4 * n16 + 8 * n
    assert whole.persistent == split.persistent == persistent
    # ... but the default plan carries foreach AdamW's square roots, 4·N, the distributed one does not
    assert whole.adam_working == 4 * n and split.adam_working == 0
    assert whole.total != split.total  # short sequences, full recompute: the step's temporaries are the peak

    default, sharded = _table(capsys), _table(capsys, "--distributed-optimizer")
    assert f"| total | {format_bytes(whole.total)} |" in default
    assert f"| total | {format_bytes(split.total)} |" in sharded
    header_default = next(line for line in default.splitlines() if line.startswith("| per rank"))
    header_sharded = next(line for line in sharded.splitlines() if line.startswith("| per rank"))
    assert "dist. opt." not in header_default
    assert header_sharded.count("dist. opt.") == 2, header_sharded  # the dense and the LoGRA column

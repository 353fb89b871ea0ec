"""The LM job's token counts: ``tokens`` / ``tokens_per_second`` are the tokens processed (global batch ×
input positions, as Megatron-LM counts throughput), ``loss_tokens`` the answer tokens the loss counts;
metrics.jsonl and TensorBoard agree. The reference counts come from the synthetic task's own batches."""

from __future__ import annotations

import json

import pytest

from megatron_logra.cli import main
from megatron_logra.config import lm_tiny
from megatron_logra.data.synthetic import SyntheticTask

LM_SMALL = ["train.progress=false", "train.eval_sequences=4", "train.eval_interval=0", "train.save_interval=0",
            "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4"]


def test_tokens_count_every_processed_token_and_loss_tokens_the_answer_tokens(tmp_path, capsys, one_thread):
    run = tmp_path / "run"
    # 2 micro-batches of 8 per step: the counts are of the whole global batch of 16
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=2", "train.global_batch_size=16",
                 "train.micro_batch_size=8", *LM_SMALL]) == 0
    capsys.readouterr()
    cfg = lm_tiny()
    task = SyntheticTask(cfg.data, cfg.model.vocab_size)
    batch = [task.microbatch(1, i, 8) for i in range(2)]
    want_tokens = sum(b.tokens.numel() for b in batch)
    want_loss_tokens = int(sum(b.loss_mask.sum().item() for b in batch))
    assert (want_tokens, want_loss_tokens) == (16 * 13, 16 * 6)  # lm-tiny: 13 input positions, 6 answer tokens

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["tokens"] == want_tokens and r["loss_tokens"] == want_loss_tokens
        assert r["tokens_per_second"] == pytest.approx(r["tokens"] / r["step_seconds"], rel=1e-9)

    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = tb.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for tag in ("tokens", "loss_tokens", "tokens_per_second"):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [1, 2]
        assert [v for _, v in got] == pytest.approx([r[tag] for r in records], rel=1e-6)

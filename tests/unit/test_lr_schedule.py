"""Learning-rate schedule (``optimizer.schedule``, ``optim/schedule.py``): warmup + decay with Megatron-LM's
semantics, applied to every lr an optimizer owns.

References, independent of the code under test:

* :func:`lr_multiplier` against megatron-core's own ``OptimizerParamScheduler`` driven as Megatron-LM's
  training loop drives it (read the param group's lr, take the optimizer step, then ``scheduler.step(1)``),
  for every style, over warmup, decay and after-decay steps;
* dense AdamW with a schedule against ``torch.optim.AdamW`` whose lr is set by hand each step from a table of
  multipliers worked out on paper;
* a LoGRA optimizer-recipe step with multiplier ``m`` against the same optimizer without a schedule at lr
  ``lr·m`` (bitwise), and its first step against the naive formula ``(1 − lr·m·wd)·W − lr·m·D·A``;
* what the KL probe and the sketch-delta sync read of a step (directions, planned native change, relative
  update norm, weight-decay factor) against the change the step actually makes;
* config errors name the field; the Megatron-LM flags resolve to the dotted fields;
* the constant default leaves a few steps bitwise equal to the code path without a schedule, and to an
  explicit multiplier of 1.0; a 3-step lm run records the scheduled lrs.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from megatron_logra.optim import DenseAdamW, LograOptimizer, NativeConfig, OptimizerConfig, build_optimizer
from megatron_logra.optim.config import LograConfig
from megatron_logra.optim.schedule import DECAY_STYLES, LRScheduleConfig, lr_multiplier
from megatron_logra.config import load_recipe, parse_args_to_config
from support.optim_models import single_thread  # noqa: F401  (an autouse fixture)
from support.optim_models import (
    F64, GROUPS, TARGETS, DenseRef, make_batch, make_mlp, mean_loss, naive_row_adam, proj, snapshot,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


# --------------------------------------------------------------------------- 1. lr_multiplier vs megatron-core


def _megatron_lrs(peak: float, cfg: LRScheduleConfig, decay_steps: int, steps: int) -> list[float]:
    """The lr of optimizer steps 1..steps as megatron-core's scheduler sets it, driven like Megatron-LM's loop."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=123.0)  # any lr: the scheduler overwrites it at construction
    sched = OptimizerParamScheduler(
        opt, init_lr=peak * cfg.warmup_init_ratio, max_lr=peak, min_lr=peak * cfg.min_lr_ratio,
        lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=cfg.decay_style,
        start_wd=0.0, end_wd=0.0, wd_incr_steps=decay_steps, wd_incr_style="constant")
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])  # what this optimizer step is taken with
        param.grad = torch.ones(2)
        opt.step()
        sched.step(increment=1)  # Megatron-LM advances after each successful update
    return lrs


SCHEDULES = [  # (config, total_steps): every style, with and without warmup, explicit and job-length decay
    (LRScheduleConfig(), 12),
    (LRScheduleConfig(warmup_steps=5), 12),
    (LRScheduleConfig(warmup_steps=4, warmup_init_ratio=0.1, decay_style="linear", decay_steps=20, min_lr_ratio=0.05),
     30),
    (LRScheduleConfig(decay_style="linear"), 16),
    (LRScheduleConfig(warmup_steps=3, decay_style="cosine", min_lr_ratio=0.1), 17),
    (LRScheduleConfig(decay_style="cosine", decay_steps=9), 40),
    (LRScheduleConfig(warmup_steps=6, warmup_init_ratio=0.25, decay_style="inverse-square-root", decay_steps=30,
                      min_lr_ratio=0.3), 30),
    (LRScheduleConfig(decay_style="inverse-square-root", min_lr_ratio=0.4), 25),  # the floor binds from n = 7
]
SCHEDULE_IDS = ["constant", "constant-warmup", "linear-warmup", "linear", "cosine-warmup", "cosine-short",
                "invsqrt-warmup", "invsqrt-floor"]


@pytest.mark.parametrize("cfg,total", SCHEDULES, ids=SCHEDULE_IDS)
def test_multiplier_equals_megatron_core_scheduler_over_warmup_decay_and_after(cfg, total):
    peak = 3e-3
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total
    steps = decay_steps + 6  # past the end of the decay: the floor
    want = _megatron_lrs(peak, cfg, decay_steps, steps)
    got = [peak * lr_multiplier(t, cfg, total) for t in range(1, steps + 1)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    if cfg.warmup_steps or cfg.decays:  # the comparison has something to catch
        assert len({round(v, 15) for v in want}) > 3
    if cfg.warmup_steps:  # Megatron-LM takes the first update at the warmup's initial lr, the peak at W + 1
        assert got[0] == pytest.approx(peak * cfg.warmup_init_ratio, abs=1e-18)
        assert got[cfg.warmup_steps] == pytest.approx(peak, rel=1e-12)


def test_constant_without_warmup_is_exactly_one_and_steps_are_one_based():
    cfg = LRScheduleConfig()
    assert cfg.is_constant and all(lr_multiplier(t, cfg, None) == 1.0 for t in (1, 2, 10**6))
    assert not LRScheduleConfig(warmup_steps=1).is_constant and not LRScheduleConfig(decay_style="linear").is_constant
    with pytest.raises(ValueError, match="1-based"):
        lr_multiplier(0, cfg, 5)
    with pytest.raises(ValueError, match=r"optimizer\.schedule\.decay_steps"):  # a decay needs its length
        lr_multiplier(3, LRScheduleConfig(decay_style="cosine"), None)


# --------------------------------------------------------------------------- 2. dense AdamW vs torch AdamW


def test_dense_adamw_follows_the_schedule_like_torch_adamw_with_the_lr_set_by_hand():
    # warmup 2 from 0, then linear to 0.1 × peak at step 6 (n = completed steps = t − 1), worked out by hand:
    # n = 0, 1, 2 -> 0, 0.5, 1; n = 3..6 -> 0.1 + 0.9·(1 − (n − 2)/4); n = 7 > 6 -> 0.1
    multipliers = [0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]
    schedule = LRScheduleConfig(warmup_steps=2, decay_style="linear", decay_steps=6, min_lr_ratio=0.1)
    peak, wd = 0.02, 0.1
    model = make_mlp(3, bias=True, norm=True)
    ref_model = copy.deepcopy(model)
    opt = DenseAdamW(model, NativeConfig(lr=peak, weight_decay=wd), GROUPS, clip_grad=0.0, schedule=schedule,
                     total_steps=len(multipliers))
    decayed = [p for p in ref_model.parameters() if p.dim() > 1]  # Megatron's groups: no decay on 1-D params
    kept = [p for p in ref_model.parameters() if p.dim() <= 1]
    ref = torch.optim.AdamW([{"params": decayed}, {"params": kept, "weight_decay": 0.0}], lr=peak,
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    for step, m in enumerate(multipliers, start=1):
        x, y = make_batch(step, (6,))
        before = snapshot(model)
        opt.zero_grad()
        mean_loss(model, x, y).backward()
        update = opt.step()
        assert update.lr_multiplier == pytest.approx(m, abs=1e-15)
        assert opt.step_lrs(update) == {"lr": pytest.approx(peak * m, rel=1e-12, abs=1e-18), "logra_lr": None}
        ref.zero_grad()
        mean_loss(ref_model, x, y).backward()
        for group in ref.param_groups:
            group["lr"] = peak * m
        ref.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-8, msg=f"step {step} {name}")
        moved = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
        assert (moved == 0.0) if m == 0.0 else (moved > 1e-4)  # lr 0 at step 1: the moments advance, nothing moves


# --------------------------------------------------------------------------- 3. LoGRA optimizer recipe


def _logra(model, schedule=None, total=None, lr=0.05, wd=0.3, native_lr=0.01):
    return LograOptimizer(model, LograConfig(targets=list(TARGETS), rank=8, clip_grad=0.0, lr=lr, weight_decay=wd),
                          NativeConfig(lr=native_lr, weight_decay=0.1), GROUPS, schedule=schedule, total_steps=total)


def _step(opt, model, seed):
    x, y = make_batch(seed, (5,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    update = opt.prepare()
    opt.apply(update)
    return update


def test_logra_step_with_multiplier_m_equals_the_step_at_lr_times_m():
    schedule = LRScheduleConfig(warmup_steps=4, warmup_init_ratio=0.25, decay_style="cosine", min_lr_ratio=0.2)
    total, lr, wd, native_lr = 7, 0.05, 0.3, 0.01
    model = make_mlp(4, bias=True, norm=True)
    by_hand = copy.deepcopy(model)
    opt = _logra(model, schedule, total, lr, wd, native_lr)
    ref = _logra(by_hand, None, None, lr, wd, native_lr)
    seen = []
    for step in range(1, total + 2):
        m = lr_multiplier(step, schedule, total)
        seen.append(m)
        ref.cfg.lr = lr * m  # the lr-less optimizer, given each step's lr (and so its weight decay) by hand
        ref.native.set_lr(native_lr * m)
        update, expected = _step(opt, model, step), _step(ref, by_hand, step)
        assert update.lr_multiplier == m and update.scale == expected.scale == lr * m
        assert opt.step_lrs(update) == {"lr": native_lr * m, "logra_lr": lr * m}
        for (name, p), q in zip(model.named_parameters(), by_hand.parameters()):
            assert torch.equal(p, q), f"step {step}: {name}"
    assert min(seen) < 0.5 and max(seen) == 1.0 and seen[-1] == 0.2  # warmup, peak and the floor were all taken


def test_logra_first_scheduled_step_is_the_naive_formula_with_lr_times_m():
    """Against DESIGN §1's update computed here: ``W ← (1 − lr·m·wd)·W − lr·m·D·A`` (RowAdam D, float64)."""
    schedule = LRScheduleConfig(warmup_steps=2, warmup_init_ratio=0.4)
    lr, wd = 0.05, 0.4
    model = make_mlp(1)
    dense = DenseRef(model)
    w0 = snapshot(model)
    opt = _logra(model, schedule, 10, lr, wd)
    x, y = make_batch(7, (5,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    update = opt.prepare()
    assert update.lr_multiplier == pytest.approx(0.4)
    opt.apply(update)
    grads = dense.grads(x, y, mean_loss)
    step_lr = lr * 0.4
    for t in opt.targets:
        name = f"{t.module_name}.weight"
        A = proj(opt, t, 0)
        D, _ = naive_row_adam(grads[name] @ A.T, torch.zeros(t.weight.shape[0], dtype=F64), 1, 0.95, 1e-8)
        expected = (1.0 - step_lr * wd) * w0[name].double() - step_lr * D @ A
        unscheduled = (1.0 - lr * wd) * w0[name].double() - lr * D @ A
        assert float((expected - unscheduled).abs().max()) > 1e-3  # far above the tolerance
        torch.testing.assert_close(t.weight.double(), expected, rtol=1e-5, atol=1e-6)


def test_what_the_kl_probe_and_the_sync_read_is_the_scheduled_step_actually_applied():
    """The directions, the planned native change (``native_deltas``), ``relative_update_norm`` and the
    weight-decay factor a sketch delta carries are those of the step's scheduled lr, read after ``apply`` too."""
    schedule = LRScheduleConfig(warmup_steps=3, warmup_init_ratio=0.2)
    model = make_mlp(5, bias=True, norm=True)
    opt = _logra(model, schedule, 10, lr=0.05, wd=0.2, native_lr=0.01)
    _step(opt, model, 1)  # step 1 at m = 0.2; test step 2, m = 0.2 + 0.8/3
    m = lr_multiplier(2, schedule, 10)
    x, y = make_batch(2, (5,))
    opt.zero_grad()
    mean_loss(model, x, y).backward()
    update = opt.prepare()
    assert update.lr_multiplier == m and 0.2 < m < 1.0
    planned = {id(p): d.clone() for p, d in opt.native_deltas(update)}
    ratio = opt.relative_update_norm(update, 1.0)
    decay = opt.weight_decay_factor(update)
    assert decay == 1.0 - 0.05 * m * 0.2
    before = snapshot(model)
    dw2 = w2 = 0.0
    for t in opt.targets:  # ΔW predicted from the update: −D·A (plus the decay, which the probe leaves out)
        name = f"{t.module_name}.weight"
        A = opt.sketches.projection_for(t, update.update_index).double()
        dw2 += float((update.directions[t.key].double() @ A).pow(2).sum())
        w2 += float(before[name].double().pow(2).sum())
    opt.apply(update)
    assert opt.weight_decay_factor(update) == decay  # after apply (as the sync reads it), still this step's
    assert opt.weight_decay_factor() == 1.0 - 0.05 * lr_multiplier(3, schedule, 10) * 0.2  # the next step's
    for name, p in model.named_parameters():
        change = p.detach().double() - before[name].double()
        if id(p) in planned:  # fp32 parameters of size ~1: the new value is rounded to ~1e-7
            assert float(planned[id(p)].abs().max()) > 1e-4
            torch.testing.assert_close(change, planned[id(p)].double(), rtol=1e-4, atol=2e-7)
        else:  # a target: decay·W − D·A
            t = next(t for t in opt.targets if f"{t.module_name}.weight" == name)
            A = opt.sketches.projection_for(t, update.update_index).double()
            torch.testing.assert_close(p.detach().double(),
                                       decay * before[name].double() - update.directions[t.key].double() @ A,
                                       rtol=1e-5, atol=1e-7)
    assert planned and ratio == pytest.approx(math.sqrt(dw2 / w2), rel=1e-6)
    # the direction carries lr·m: at the unscheduled lr the change would be 1/m times larger
    assert update.scale == pytest.approx(0.05 * m)


# --------------------------------------------------------------------------- 4. the constant default


@pytest.mark.parametrize("kind", ["logra", "adam"])
def test_constant_default_is_bitwise_the_unscheduled_path_and_an_explicit_multiplier_of_one(kind):
    # min_lr_ratio = 1 makes a linear decay evaluate to exactly 1.0 through the decay branch
    explicit_one = LRScheduleConfig(decay_style="linear", decay_steps=2, min_lr_ratio=1.0)
    runs = []
    for schedule in (None, LRScheduleConfig(), explicit_one):
        model = make_mlp(6, bias=True, norm=True)
        if kind == "logra":
            opt = _logra(model, schedule, 4)
        else:
            opt = DenseAdamW(model, NativeConfig(lr=0.02, weight_decay=0.1), GROUPS, clip_grad=0.5,
                             schedule=schedule, total_steps=4)
        records = []
        for step in range(1, 5):
            update = _step(opt, model, step)
            records.append((update.grad_norm, update.clip_coef, update.scale, opt.step_lrs(update)))
        runs.append((records, snapshot(model)))
    (rec0, w0), *others = runs
    assert rec0[0][3]["lr"] in (0.01, 0.02)
    for records, weights in others:
        assert records == rec0
        assert all(torch.equal(weights[n], w0[n]) for n in w0)


def test_native_state_records_the_configured_lr_not_the_scheduled_one():
    schedule = LRScheduleConfig(warmup_steps=5)
    model = make_mlp(2, bias=True)
    opt = _logra(model, schedule, 10, native_lr=0.01)
    _step(opt, model, 1)
    _step(opt, model, 2)
    assert opt.native.inner.param_groups[0]["lr"] == pytest.approx(0.01 * 0.2)  # step 2's scheduled lr
    scalars, _ = opt.native.sharded_state()
    assert scalars["lr"] == 0.01
    assert all(g["lr"] == 0.01 for g in opt.native.state_dict()["inner"]["param_groups"])


# --------------------------------------------------------------------------- 5. config validation


@pytest.mark.parametrize("kwargs,field", [
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_init_ratio": 1.5}, "warmup_init_ratio"),
    ({"min_lr_ratio": float("nan")}, "min_lr_ratio"),
    ({"min_lr_ratio": -0.1}, "min_lr_ratio"),
    ({"decay_style": "WSD"}, "decay_style"),
    ({"decay_steps": 0}, "decay_steps"),
    ({"decay_style": "linear", "warmup_steps": 10, "decay_steps": 10}, "decay_steps"),
])
def test_schedule_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"optimizer\.schedule\.{field}="):
        LRScheduleConfig(**kwargs)


def test_decay_style_error_names_the_accepted_styles():
    with pytest.raises(ValueError) as err:
        LRScheduleConfig(decay_style="WSD")
    assert all(style in str(err.value) for style in DECAY_STYLES)


def test_job_steps_must_exceed_the_warmup_and_a_schedule_must_reach_some_lr():
    with pytest.raises(ValueError, match=r"over train\.steps=250.*optimizer\.schedule\.warmup_steps=250"):
        parse_args_to_config("lm-tiny", ["schedule.warmup_steps=250", "schedule.decay_style=cosine"])
    with pytest.raises(ValueError, match=r"over rl\.steps=60"):
        parse_args_to_config("tiny", ["--lr-warmup-iters", "60", "--lr-decay-style", "linear"])
    assert parse_args_to_config("lm-tiny", ["schedule.warmup_steps=250"]).optimizer.schedule.warmup_steps == 250
    with pytest.raises(ValueError, match=r"optimizer\.schedule .*changes nothing"):
        OptimizerConfig(logra=LograConfig(recipe="paper"), native=NativeConfig(freeze=True),
                        schedule=LRScheduleConfig(warmup_steps=3))
    with pytest.raises(ValueError, match=r"optimizer\.schedule\.decay_steps"):
        build_optimizer(make_mlp(0), OptimizerConfig(logra=LograConfig(targets=list(TARGETS), rank=4),
                                                     schedule=LRScheduleConfig(decay_style="cosine")), GROUPS)


# --------------------------------------------------------------------------- 6. Megatron-LM flags


def test_megatron_schedule_flags_resolve_to_the_dotted_fields_in_any_order():
    flags = ["--min-lr", "6e-4", "--lr-warmup-iters", "10", "--lr-decay-iters", "200", "--lr-decay-style",
             "cosine", "--lr-warmup-init", "3e-4", "--lr", "6e-3"]  # --min-lr before the --lr it is the floor of
    s = parse_args_to_config("lm-tiny", flags).optimizer.schedule
    assert (s.warmup_steps, s.decay_steps, s.decay_style) == (10, 200, "cosine")
    assert (s.min_lr, s.min_lr_ratio) == (6e-4, 0.0)  # as given
    assert (s.warmup_init_lr, s.warmup_init_ratio) == (3e-4, 0.0)
    dense = parse_args_to_config("tiny-adam", ["--lr", "2e-3", "--min-lr", "5e-4"])  # dense AdamW: native.lr
    assert dense.optimizer.native.lr == 2e-3 and dense.optimizer.schedule.min_lr == 5e-4
    paper = parse_args_to_config("tiny", ["logra.recipe=paper", "native.freeze=false", "native.lr=4e-3",
                                          "--min-lr", "1e-3", "--lr-decay-style", "linear"])
    assert paper.optimizer.schedule.min_lr == 1e-3  # the paper recipe: the floor of the native AdamW's lr
    assert parse_args_to_config("lm-tiny", ["schedule.decay_steps=5"]).optimizer.schedule.decay_steps == 5


def test_yaml_recipe_takes_the_megatron_schedule_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: lm-tiny\nlr-decay-style: inverse-square-root\nlr-warmup-iters: 4\nmin-lr: 3.0e-4\n")
    s = load_recipe(str(path)).optimizer.schedule
    assert (s.decay_style, s.warmup_steps, s.min_lr) == ("inverse-square-root", 4, 3.0e-4)


@pytest.mark.parametrize("flags,match", [
    (["--lr-decay-style", "WSD"], r"decay_style='WSD'.*constant, linear, cosine, inverse-square-root"),
    (["--lr", "0", "--min-lr", "0"], r"--min-lr=0\.0 .*optimizer\.logra\.lr, which is 0"),
    (["--min-lr", "1e-2"], r"--min-lr=0\.01 exceeds the peak lr optimizer\.logra\.lr=0\.003"),
    (["--lr-warmup-init", "-1"], r"--lr-warmup-init=-1\.0 must be a finite lr"),
    (["--min-lr", "1e-4", "schedule.min_lr_ratio=0.1"], r"optimizer\.schedule\.min_lr=0\.0001 and optimizer\.schedule"
                                                        r"\.min_lr_ratio=0\.1 both set the floor"),
])
def test_megatron_schedule_flags_are_refused_with_the_reason(flags, match):
    with pytest.raises(ValueError, match=match):
        parse_args_to_config("lm-tiny", flags)


def test_min_lr_is_refused_where_no_lr_follows_a_schedule():
    with pytest.raises(ValueError, match=r"--min-lr sets optimizer\.schedule\.min_lr, but no lr follows"):
        parse_args_to_config("tiny", ["logra.recipe=paper", "--min-lr", "1e-5"])  # tiny freezes the non-targets


# --------------------------------------------------------------------------- 7. a short lm run's records


LM_SCHEDULED = ["train.global_batch_size=8", "train.micro_batch_size=8", "train.progress=false",
                "train.eval_sequences=4", "train.eval_interval=0", "train.save_interval=0", "--num-layers", "1",
                "--hidden-size", "32", "--ffn-hidden-size", "64", "logra.rank=4", "native.lr=1e-3", "--lr", "4e-3",
                "--lr-warmup-iters", "1", "--lr-decay-style", "linear", "--lr-decay-iters", "3", "--min-lr", "1e-3"]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lm_run_records_the_scheduled_lrs_and_resumes_bitwise(tmp_path, one_thread):
    from megatron_logra.cli import main

    run = tmp_path / "run"
    assert main(["train", "lm-tiny", f"train.run_dir={run}", "train.steps=3", *LM_SCHEDULED]) == 0
    records = _records(run)
    # n = 0: warmup from 0; n = 1: the peak; n = 2: linear to 0.25 × peak at 3 steps: 0.25 + 0.75·(1 − 1/2)
    multipliers = [0.0, 1.0, 0.625]
    assert [r["logra_lr"] for r in records] == pytest.approx([4e-3 * m for m in multipliers], rel=1e-12, abs=1e-18)
    assert [r["lr"] for r in records] == pytest.approx([1e-3 * m for m in multipliers], rel=1e-12, abs=1e-18)
    assert "min_lr: 0.001" in (run / "config.yaml").read_text()  # the saved config holds the floor as given
    # 2 steps, then resumed from that checkpoint to 3: step 3 (lr, loss, its update) is bitwise the uninterrupted one
    parted = tmp_path / "parted"
    assert main(["train", "lm-tiny", f"train.run_dir={parted}", "train.steps=2", *LM_SCHEDULED]) == 0
    assert main(["train", "--resume", str(parted), "train.steps=3"]) == 0
    assert [r["step"] for r in _records(parted)] == [1, 2, 3]
    assert _records(parted) == [{**r, "step_seconds": p["step_seconds"], "tokens_per_second": p["tokens_per_second"]}
                                for r, p in zip(records, _records(parted))]
    summary = [json.loads((d / "summary.json").read_text()) for d in (run, parted)]
    assert summary[0]["eval_loss_after"] == summary[1]["eval_loss_after"]

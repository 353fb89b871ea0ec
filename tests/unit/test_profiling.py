"""The profile window: which steps land in the trace, which ranks write, and bad settings refused."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
import torch

from megatron_logra.profiling import ProfileConfig, StepProfiler, check_profile, phase

CPU = torch.device("cpu")


def _run_steps(profiler: StepProfiler, steps, stop_after=None) -> None:
    x = torch.randn(32, 32)
    for n in steps:
        with profiler.step(n):
            with phase(f"test/step{n}"):
                (x @ x).sum()
        if stop_after is not None and n == stop_after:
            break
    profiler.close()


def _trace_names(path) -> set[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name") for e in events if isinstance(e, dict)}


def _labelled_steps(names: set[str]) -> set[int]:
    return {int(n[len("test/step"):]) for n in names if n and n.startswith("test/step")}


def test_window_records_exactly_its_steps(tmp_path):
    cfg = ProfileConfig(enabled=True, step_start=2, step_end=4)
    prof = StepProfiler(cfg, tmp_path, rank=0, device=CPU)
    _run_steps(prof, range(1, 7))
    trace, table = tmp_path / "profile" / "rank0-steps2-3.json.gz", tmp_path / "profile" / "rank0-steps2-3.txt"
    assert prof.written == [trace, table]
    assert _labelled_steps(_trace_names(trace)) == {2, 3}
    text = table.read_text(encoding="utf-8")
    assert "aten::mm" in text and "self_cpu_time_total" in text
    phases, _, ops = text.partition("ops and ranges")
    phase_rows = {line.split()[0]: line.split() for line in phases.splitlines() if line.startswith("test/")}
    assert set(phase_rows) == {"test/step2", "test/step3"}  # one call each: the window's two steps only
    assert all(row[1] == "1" for row in phase_rows.values())
    assert "aten::mm" in ops and "aten::mm" not in phases


def test_other_ranks_and_disabled_write_nothing(tmp_path):
    on_rank1 = ProfileConfig(enabled=True, step_start=1, step_end=3, ranks=[1])
    _run_steps(StepProfiler(on_rank1, tmp_path / "r0", rank=0, device=CPU), range(1, 4))
    _run_steps(StepProfiler(ProfileConfig(enabled=False, step_start=1, step_end=3), tmp_path / "off", rank=0,
                            device=CPU), range(1, 4))
    assert not (tmp_path / "r0" / "profile").exists() and not (tmp_path / "off" / "profile").exists()
    _run_steps(StepProfiler(on_rank1, tmp_path / "r1", rank=1, device=CPU), range(1, 4))
    assert (tmp_path / "r1" / "profile" / "rank1-steps1-2.json.gz").is_file()


def test_resume_inside_and_after_the_window(tmp_path, caplog):
    cfg = ProfileConfig(enabled=True, step_start=2, step_end=5)
    inside = StepProfiler(cfg, tmp_path / "inside", rank=0, device=CPU)
    _run_steps(inside, range(3, 8))  # resumed at step 2: steps 3 and 4 are what is left of the window
    assert _labelled_steps(_trace_names(inside.written[0])) == {3, 4}
    after = StepProfiler(cfg, tmp_path / "after", rank=0, device=CPU)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.profiling"):
        _run_steps(after, range(6, 8))
    assert after.written == [] and not (tmp_path / "after" / "profile").exists()
    assert "lies before step 6" in caplog.text


def test_run_stopped_inside_the_window_keeps_what_it_recorded(tmp_path):
    prof = StepProfiler(ProfileConfig(enabled=True, step_start=2, step_end=9), tmp_path, rank=0, device=CPU)
    _run_steps(prof, range(1, 10), stop_after=3)
    assert prof.written and prof.written[0].name == "rank0-steps2-3.json.gz"
    assert _labelled_steps(_trace_names(prof.written[0])) == {2, 3}


def test_unwritable_profile_dir_does_not_stop_the_run(tmp_path, caplog):
    (tmp_path / "profile").write_text("a file where the directory would go")
    prof = StepProfiler(ProfileConfig(enabled=True, step_start=1, step_end=2), tmp_path, rank=0, device=CPU)
    with caplog.at_level(logging.ERROR, logger="megatron_logra.profiling"):
        _run_steps(prof, range(1, 4))
    assert prof.written == []
    assert "the run goes on without the profile" in caplog.text


@pytest.mark.parametrize("kwargs, field", [
    (dict(tool="nvprof"), "profile.tool"),
    (dict(step_start=0), "profile.step_start"),
    (dict(step_start=5, step_end=5), "profile.step_end"),
    (dict(ranks=[]), "profile.ranks"),
    (dict(ranks=[-1]), "profile.ranks"),
    (dict(ranks=0), "profile.ranks"),
    (dict(enabled="yes"), "profile.enabled"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ProfileConfig(**kwargs)


def test_ranks_are_deduplicated_and_sorted():
    assert ProfileConfig(ranks=[8, 0, 8]).ranks == [0, 8]


def test_check_profile_refuses_what_the_job_cannot_take():
    check_profile(ProfileConfig(enabled=False, ranks=[9]), world_size=2, cuda=False)  # off: nothing checked
    with pytest.raises(ValueError, match=r"rank\(s\) \[2\] do not exist"):
        check_profile(ProfileConfig(enabled=True, ranks=[0, 2]), world_size=2, cuda=False)
    with pytest.raises(ValueError, match="profile.tool=nsys needs a CUDA device"):
        check_profile(ProfileConfig(enabled=True, tool="nsys"), world_size=1, cuda=False)
    check_profile(ProfileConfig(enabled=True, ranks=[0, 1]), world_size=2, cuda=False)


def _ranges(trace_path) -> dict[str, tuple[float, float]]:
    with gzip.open(trace_path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
            if isinstance(e, dict) and str(e.get("name", "")).startswith("p/") and "dur" in e}


def test_phases_are_consecutive_and_the_last_ends_on_an_exception(tmp_path):
    from megatron_logra.profiling import Phases

    prof = StepProfiler(ProfileConfig(enabled=True, step_start=1, step_end=2), tmp_path, rank=0, device=CPU)
    x = torch.randn(64, 64)
    with pytest.raises(RuntimeError, match="boom"):
        with prof.step(1):
            with Phases("p") as ph:
                ph.next("a")
                (x @ x).sum()
                ph.next("b")
                (x @ x).sum()
                raise RuntimeError("boom")
    assert prof.written and prof.written[0].name == "rank0-steps1-1.json.gz"  # written as the step raised
    prof.close()
    spans = _ranges(prof.written[0])
    assert set(spans) == {"p/a", "p/b"}
    assert spans["p/a"][1] <= spans["p/b"][0]  # "a" ends before "b" starts: no nesting


def test_run_that_ends_before_the_window_says_nothing_was_profiled(tmp_path, caplog):
    """``--profile`` with the default window (10-12) on a shorter run: a warning, not silence."""
    prof = StepProfiler(ProfileConfig(enabled=True), tmp_path, rank=0, device=CPU)
    with caplog.at_level(logging.WARNING, logger="megatron_logra.profiling"):
        _run_steps(prof, range(1, 6))
        prof.close()  # a second close says it once
    assert prof.written == [] and not (tmp_path / "profile").exists()
    assert caplog.text.count("profile window [10, 12) starts after step 5") == 1
    caplog.clear()
    quiet = StepProfiler(ProfileConfig(enabled=True), tmp_path, rank=1, device=CPU)  # not a profiled rank
    with caplog.at_level(logging.WARNING, logger="megatron_logra.profiling"):
        _run_steps(quiet, range(1, 6))
        StepProfiler(ProfileConfig(enabled=True), tmp_path, rank=0, device=CPU).close()  # no step ran
    assert "profile window" not in caplog.text

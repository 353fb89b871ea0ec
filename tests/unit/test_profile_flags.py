"""Megatron-LM's profiling flags, and a list flag given Megatron-LM's way (several arguments)."""

from __future__ import annotations

import pytest

from megatron_logra.config import parse_args_to_config


def test_megatron_profiling_flags_set_the_profile_section():
    cfg = parse_args_to_config("tiny", ["--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
                                        "--profile-step-end", "6", "--profile-ranks", "1,0"])
    p = cfg.profile
    assert (p.enabled, p.tool, p.step_start, p.step_end, p.ranks) == (True, "torch", 3, 6, [0, 1])
    assert parse_args_to_config("lm-tiny", ["profile.tool=nsys", "--profile"]).profile.tool == "nsys"
    assert parse_args_to_config("tiny", []).profile.enabled is False


def test_profile_values_are_checked_on_the_command_line():
    with pytest.raises(ValueError, match=r"profile\.step_end=4 must be > profile\.step_start=5"):
        parse_args_to_config("tiny", ["--profile-step-start", "5", "--profile-step-end", "4"])
    with pytest.raises(ValueError, match=r"profile\.tool='perf'"):
        parse_args_to_config("tiny", ["profile.tool=perf"])


def test_a_second_value_after_a_list_flag_says_to_use_commas():
    with pytest.raises(ValueError, match=r"'1' follows --profile-ranks 0.*--profile-ranks 0,1"):
        parse_args_to_config("tiny", ["--profile-ranks", "0", "1"])
    with pytest.raises(ValueError, match=r"--task\.weights 1,2"):
        parse_args_to_config("tiny", ["--task.weights", "1", "2"])


def test_a_stray_argument_after_a_scalar_flag_gets_no_list_hint():
    with pytest.raises(ValueError) as info:
        parse_args_to_config("tiny", ["--seed", "3", "junk"])
    assert "cannot parse override 'junk'" in str(info.value) and "commas" not in str(info.value)


def test_megatron_profiler_collect_flags_set_shapes_and_stacks():
    cfg = parse_args_to_config("tiny", ["--profile", "--pytorch-profiler-collect-shapes",
                                        "--pytorch-profiler-collect-callstack"])
    assert (cfg.profile.record_shapes, cfg.profile.with_stack, cfg.profile.profile_memory) == (True, True, False)


def test_every_flag_the_profile_section_names_is_one_the_parser_accepts():
    """The field docs (``megatron-logra config``, the API) name Megatron-LM flags; each must parse here."""
    import inspect
    import re

    from megatron_logra.megatron_flags import known_flags
    from megatron_logra.profiling import ProfileConfig

    # "(--flag)", "; --flag)", "``--flag``": a flag of this trainer (not nsys's ``--capture-range=...``)
    named = set(re.findall(r"(?:\(|; |``)--([a-z][a-z0-9-]+)(?=\)|``)", inspect.getsource(ProfileConfig)))
    assert {"profile", "pytorch-profiler-collect-shapes"} <= named
    assert not named - set(known_flags()), f"named but unknown: {sorted(named - set(known_flags()))}"

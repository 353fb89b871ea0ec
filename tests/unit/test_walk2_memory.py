"""``megatron-logra memory`` refuses a GPU size no GPU has (a unit typo: 80MB for 80GB) instead of planning it."""

from __future__ import annotations

import pytest

from megatron_logra.memory.cli import main


@pytest.mark.parametrize("size", ["80MB", "1B", "1023MiB"])
def test_a_gpu_memory_under_one_gib_is_one_error_line(size, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model", "qwen2.5-1.5b", "--gpu-memory", size])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megatron-logra memory: error: --gpu-memory") and size in err and "less than 1 GiB" in err


def test_one_gib_still_plans(capsys):
    assert main(["--model", "qwen2.5-1.5b", "--tp", "2", "--gpu-memory", "1GiB,80GiB", "--markdown"]) == 0
    assert "OOM" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--model", ",27b"), ("--gpu-memory", "80GiB,"),
                                        ("--targets", "linear_qkv,,linear_proj")])
def test_a_stray_comma_is_refused_not_dropped(flag, value, capsys):
    argv = {"--model": "27b", "--gpu-memory": "80GiB", "--tp": "8"}
    argv[flag] = value
    with pytest.raises(SystemExit) as exc:
        main([arg for item in argv.items() for arg in item])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"megatron-logra memory: error: {flag} {value!r}: an empty item"), err

"""``megatron-logra memory``: sizes without a unit, DP 0 and overflowing sizes are clear errors (exit 2)."""

from __future__ import annotations

import pytest

from megatron_logra.memory.cli import main
from megatron_logra.memory.units import GiB, parse_bytes

BASE = ["--model", "qwen2.5-1.5b", "--markdown"]


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(BASE + argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["--gpu-memory", "80"], "--gpu-memory 80: give a unit, e.g. 80GiB"),
    (["--gpu-memory", "80GiB,141"], "--gpu-memory 141: give a unit"),
    (["--overhead", "2"], "--overhead 2: give a unit"),
    (["--dp", "0"], "dp=0 must be an integer >= 1"),
    (["--gpu-memory", "1e400GiB"], "--gpu-memory 1e400GiB"),
    (["--gpu-memory", "1e400"], "--gpu-memory 1e400"),
    (["--overhead", "1e400B"], "--overhead 1e400B"),
    (["--pp", "0", "--tp", "auto"], "pp=0 must be an integer >= 1"),
    (["--gpus", "0", "--tp", "auto"], "gpus=0 must be an integer >= 1"),
    (["--gpus", "-8"], "gpus=-8 must be an integer >= 1"),
])
def test_memory_cli_bad_values(capsys, argv, expected):
    assert expected in _error(capsys, argv)


def test_memory_cli_accepts_explicit_units(capsys):
    assert main(BASE + ["--gpu-memory", "80GiB,81559MiB,85899345920B", "--overhead", "0"]) == 0


def test_parse_bytes_require_unit_and_overflow():
    assert parse_bytes("80GiB", require_unit=True) == 80 * GiB
    assert parse_bytes("512B", require_unit=True) == 512
    assert parse_bytes("0", require_unit=True) == 0
    with pytest.raises(ValueError, match="80 bytes[?]"):
        parse_bytes("80", name="--gpu-memory", require_unit=True)
    assert parse_bytes("80") == 80   # the library default still reads a bare number as bytes
    for bad in ("1e400GiB", "1e400", float("inf"), 10**400):
        with pytest.raises(ValueError, match="too large|finite"):
            parse_bytes(bad, name="gpu_memory")

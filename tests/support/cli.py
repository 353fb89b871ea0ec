"""Running the ``megatron-logra`` command line in this process, as tests of its error reports need it."""

from __future__ import annotations

import pytest


def exit_2(argv: list[str], capsys) -> str:
    """``megatron_logra.cli.main(argv)`` must exit with status 2, reporting ``megatron-logra: error: ...`` without
    a traceback; its stderr."""
    from megatron_logra.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "megatron-logra: error: " in err and "Traceback" not in err
    return err


def eval_ok(run, *args: str) -> None:
    """``megatron-logra eval RUN ARGS...`` in this process must succeed (its JSON goes to stdout); warnings
    silenced, megatron's parallel state destroyed afterwards (also on failure)."""
    import warnings

    from megatron_logra.cli import main
    from megatron_logra.parallel import destroy_parallel

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert main(["eval", str(run), *args]) == 0
    finally:
        destroy_parallel()


@pytest.fixture(autouse=True)
def one_process_cli(monkeypatch):
    """Every test of a module that imports this runs the CLI as one process: no torchrun environment, and errors
    reported as exit status 2 (no re-raise)."""
    for name in ("WORLD_SIZE", "RANK", "MEGATRON_LOGRA_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)

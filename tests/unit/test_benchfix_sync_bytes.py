"""``benchmarks/sync_bytes.py --baseline-rev``: a revision that git cannot show is a one-line usage error
carrying git's own message, and the scratch directory of the baseline modules is removed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_bytes_bench", ROOT / "benchmarks" / "sync_bytes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _refused(sb, rev, tmp_path, monkeypatch, capsys) -> str:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(SystemExit) as exc:
        sb.main(["--baseline-rev", rev, "--repeats", "1", "--out", str(tmp_path / "out" / "x.md")])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{Path(sys.argv[0]).name}: error: argument --baseline-rev:"), err
    assert not any(scratch.iterdir()), "the baseline's scratch directory was left behind"
    assert not (tmp_path / "out").exists()
    return last


def test_unknown_revision_is_one_line_with_gits_message(sb, tmp_path, monkeypatch, capsys):
    """Was a ``CalledProcessError`` traceback (exit 1) that dropped git's "invalid object name"."""
    last = _refused(sb, "nosuchrev", tmp_path, monkeypatch, capsys)
    assert "'nosuchrev'" in last and "megatron_logra/sketch/random_projection.py" in last
    git = subprocess.run(["git", "-C", str(ROOT), "show", "nosuchrev:megatron_logra/sketch/random_projection.py"],
                         capture_output=True, text=True)
    assert git.returncode != 0 and " ".join(git.stderr.split()) in last


def test_revision_older_than_the_files_names_the_missing_file(sb, tmp_path, monkeypatch, capsys):
    root = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                          text=True).stdout.split()
    required = [path for mod, path in sb._BASELINE_FILES.items() if mod not in sb._OPTIONAL_BASELINE_FILES]
    missing = [(rev, path) for rev in root for path in required
               if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:{path}"],
                                 capture_output=True).returncode != 0]
    if not missing:
        pytest.skip("the first commit already has every baseline file")
    rev, path = missing[0]
    last = _refused(sb, rev, tmp_path, monkeypatch, capsys)
    assert rev in last and path in last


PRE_SPLIT = "16758500046cb654628387e90443cbb9721bea8e"
"""The last commit before ``sketch/random_projection.py`` and ``sync/apply.py`` were split: a revision without the
optional baseline files."""
SPLIT_OUT = ("megatron_logra/sketch/entry_hash.py", "megatron_logra/sync/delta_checks.py",
             "megatron_logra/sync/staged_delta.py")
"""The modules split out of the baseline files: copied with them wherever a revision has them."""


def _has(rev: str, path: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:{path}"],
                          capture_output=True).returncode == 0


@pytest.fixture
def clean_baseline_imports(sb):
    """The baseline modules and their scratch directory on ``sys.path`` are this test's own."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for mod in sb._BASELINE_FILES:
        sys.modules.pop(mod, None)


@pytest.mark.parametrize("rev", ["HEAD", PRE_SPLIT])
def test_baseline_before_and_after_the_split_is_wired_to_its_own_copies(sb, rev, clean_baseline_imports):
    """Every baseline file ``rev`` has is copied and imported from the copies, none from the current tree; one it lacks
    (a revision before the split) is skipped. The copies compute what the current code does on a tiny input."""
    import importlib

    import torch

    from megatron_logra.sketch.random_projection import projection
    from megatron_logra.sync import apply_delta_, decode, encode
    from megatron_logra.sync.synthetic import DenseShape, random_delta

    if not _has(rev, "megatron_logra/sync/apply.py"):
        pytest.skip(f"{rev} is not in this clone's history (a shallow clone?)")
    optional = {m for m in sb._OPTIONAL_BASELINE_FILES if _has(rev, sb._BASELINE_FILES[m])}
    assert {p for p in SPLIT_OUT if _has(rev, p)} == {sb._BASELINE_FILES[m] for m in optional}
    if rev == PRE_SPLIT:
        assert not optional
    else:  # the commit under test: every split-out file (none before the split was committed)
        assert optional in (set(), set(sb._OPTIONAL_BASELINE_FILES))
    factory = sb._load_baseline(rev)
    loaded = {m: importlib.import_module(m) for m in sb._BASELINE_FILES
              if m not in sb._OPTIONAL_BASELINE_FILES or m in optional}
    current = {path.removesuffix(".py").replace("/", ".") for path in (*sb._BASELINE_FILES.values(), *SPLIT_OUT)}
    for name, module in loaded.items():
        assert ROOT not in Path(module.__file__).resolve().parents, f"{name} is not a copy: {module.__file__}"
        for attr, value in vars(module).items():  # a function or class of a copied file comes from its copy
            assert getattr(value, "__module__", None) not in current, f"{name}.{attr} is the current tree's"
    wired = {"baseline_entry_hash": ("baseline_projection", "projection_key"),
             "baseline_delta_checks": ("baseline_apply", "check_version"),
             "baseline_staged_delta": ("baseline_apply", "StagedDelta")}
    for mod in optional:  # the split-out code is imported by the copies of the files it came from
        user, attr = wired[mod]
        assert getattr(loaded[user], attr).__module__ == mod

    for dist in ("rademacher", "gaussian"):
        args = (7, "model.layers.1.mlp.down_proj", 3, 4, 40)
        assert torch.equal(loaded["baseline_projection"].projection(*args, distribution=dist, cols=range(5, 30)),
                           projection(*args, distribution=dist, cols=range(5, 30)))
    shape = DenseShape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=50)
    gen = torch.Generator().manual_seed(0)
    before = {k: torch.randn(*s, generator=gen) * 0.02 for k, s in shape.hf_shapes().items()}
    ours, theirs = ({k: v.clone() for k, v in before.items()} for _ in range(2))
    delta = decode(encode(random_delta(shape, 8, scale=1e-3)))
    assert factory()(theirs, delta, delta.base_version) == apply_delta_(ours, delta, delta.base_version) == 1
    assert all(torch.equal(theirs[k], ours[k]) for k in before)
    assert not all(torch.equal(ours[k], before[k]) for k in before), "the delta changed no weight"

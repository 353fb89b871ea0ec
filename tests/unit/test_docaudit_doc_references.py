"""What the documentation names exists: every dotted config field (``rl.loss.kl_coef``, ``logra.rank``, ...) of
README.md, docs/*.md and examples/ is a field of the real config dataclasses, every relative link (and its
``#anchor``) points to a file and heading that exist, and every repository path quoted in the pages
(``tools/setup.sh``, ``megatron_logra/rewards/remote.py``, ``rl/teachers.py``) is a file of the checkout."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from megatron_logra.config.run import RunConfig
from support.docs import ROOT, doc_pages

SHORT = {"logra": "optimizer.logra", "native": "optimizer.native", "schedule": "optimizer.schedule"}
"""The short prefixes the override parser accepts."""

NOT_FIELDS = {
    "rl.stepz",  # docs/checkpoints.md: the misspelt key a resume refuses
    "data.val_files",  # verl's option, named as the counterpart of task.eval_datasets
    "sync.apply.stage_delta",  # a function of the megatron_logra.sync.apply module
    "model.layers",  # Hugging Face module names (model.layers.3.self_attn.q_proj)
    "train.wandb_",  # train.wandb_* fields, as a group
}
"""Dotted names in the pages that are no config field, on purpose."""

FILE_SUFFIXES = ("md", "py", "json", "jsonl", "yaml", "safetensors", "sh", "txt", "png")
"""``data.md``, ``train.py``, ``model.safetensors``: file names, not fields."""


def _fields(cls: type, prefix: str = "") -> dict[str, bool]:
    """Every dotted field path of dataclass ``cls`` -> whether it is a free-form mapping (``task.dataset_kwargs``),
    whose keys are the user's."""
    hints = typing.get_type_hints(cls)
    out: dict[str, bool] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        section = kind if dataclasses.is_dataclass(kind) else next(
            (a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)), None)
        path = prefix + f.name
        out[path] = section is None and (kind is dict or typing.get_origin(kind) is dict or any(
            a is dict or typing.get_origin(a) is dict for a in typing.get_args(kind)))
        if section is not None:
            out.update(_fields(section, path + "."))
    return out


FIELDS = _fields(RunConfig)
SECTIONS = sorted({p.split(".")[0] for p in FIELDS if "." in p} | set(SHORT))
_DOTTED = re.compile(r"(?<![\w./$-])(" + "|".join(SECTIONS) + r")\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _pages() -> list[Path]:
    return [*doc_pages(), *sorted(p for p in (ROOT / "examples").iterdir() if p.is_file())]


def _is_field(name: str) -> bool:
    head, _, rest = name.partition(".")
    parts = (SHORT.get(head, head) + "." + rest).split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in FIELDS:
            return k == len(parts) or FIELDS[prefix]  # past a field only into a free-form mapping
    return False


def documented_fields(text: str) -> list[str]:
    """The dotted config names of ``text`` (file names such as ``data.md`` left out)."""
    names = []
    for m in _DOTTED.finditer(text):
        name = m.group(0)
        if name.rsplit(".", 1)[1] in FILE_SUFFIXES or text[m.end():m.end() + 1] in ("*", "/"):
            continue
        names.append(name)
    return names


def test_the_field_scan_finds_fields_and_misses():
    text = "`rl.loss.kl_coef > 0`, `logra.rank=8`, task.dataset_kwargs.chain_sum.min_terms, see data.md"
    assert documented_fields(text) == ["rl.loss.kl_coef", "logra.rank", "task.dataset_kwargs.chain_sum.min_terms"]
    assert all(_is_field(n) for n in documented_fields(text))
    assert not _is_field("rl.num_steps") and not _is_field("logra.rnak") and not _is_field("rl.loss.kl_coef.x")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_field_exists(page):
    names = documented_fields(page.read_text())
    unknown = sorted({n for n in names if n not in NOT_FIELDS and not _is_field(n)})
    assert not unknown, f"{page.relative_to(ROOT)} names fields the config does not have: {unknown}"


def test_the_pages_name_many_fields():
    assert len({n for p in _pages() for n in documented_fields(p.read_text())}) > 100


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path) if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_pages_link_to_each_other():
    assert sum(len(_links(p)) for p in doc_pages()) > 20


_REPO_PATH = re.compile(r"(?<![\w/.~-])((?:tools|benchmarks|megatron_logra|tests|examples|docker|docs)/[\w./-]*\w)(?![\w*{])")
_PACKAGE_PATH = re.compile(r"`((?:[a-z_]+/)+[a-z_]\w*\.py)`")


def quoted_paths(text: str) -> set[str]:
    """Repository paths quoted in ``text``: ``tools/setup.sh``, and package modules as ``rl/teachers.py``
    (``megatron_logra/rl/teachers.py``); globs (``examples/train_*.sh``) left out."""
    paths = set(_REPO_PATH.findall(text))
    return paths | {f"megatron_logra/{p}" for p in _PACKAGE_PATH.findall(text) if p.split("/")[0] not in (
        "tools", "benchmarks", "megatron_logra", "tests", "examples", "docker", "docs")}


def test_the_path_scan_finds_paths():
    text = "`tools/setup.sh` (`rl/teachers.py`, `examples/train_*.sh`, [x](docs/usage.md#a))"
    assert quoted_paths(text) == {"tools/setup.sh", "megatron_logra/rl/teachers.py", "docs/usage.md"}


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_repository_paths_exist(page):
    missing = sorted(p for p in quoted_paths(page.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{page.relative_to(ROOT)} quotes paths that do not exist: {missing}"


def test_the_readme_links_every_page():
    readme = doc_pages()[0]
    linked = {(readme.parent / link.partition("#")[0]).resolve() for link in _links(readme)}
    unlinked = [p.name for p in doc_pages()[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md links no docs page {unlinked}"

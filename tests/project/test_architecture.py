"""docs/architecture.md maps the whole package: every package under megatronish/ (a folder of
.py files, by its path: `fp8/`, `accounting/collectives/`) and every module directly in
megatronish/ (`errors.py`) is named in it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"


def unmapped(package: Path, text: str) -> list[str]:
    """The names of package's sub-packages ('a/b/') and top-level modules ('x.py', not
    __init__.py) that text does not mention as a word."""
    folders = {p.parent for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    names = [f"{f.relative_to(package).as_posix()}/" for f in sorted(folders) if f != package]
    names += [p.name for p in sorted(package.glob("*.py")) if p.name != "__init__.py"]
    return [n for n in names if not re.search(rf"(?<![\w/.]){re.escape(n)}", text)]


def test_every_package_and_top_level_module_is_in_the_architecture_map():
    missing = unmapped(REPO / "megatronish", ARCHITECTURE.read_text())
    assert not missing, f"not in docs/architecture.md: {', '.join(missing)}"


def test_a_package_missing_from_the_map_is_named(tmp_path):
    for name in ("a/x.py", "a/b/y.py", "c/z.py", "top.py", "__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert unmapped(tmp_path, "a/ holds x; top.py; see b/ and a/c/") == ["a/b/", "c/"]

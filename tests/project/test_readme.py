"""The README and the config reference stay true: the README's three commands come first, the
config reference in docs/config.md is the one generated from megatronish/config/schema.py, its
table of shipped configs names every file of configs/, and what the docs' examples write into
the checkout is ignored."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.project.test_docs import readme_commands

START = "<!-- config-reference:start -->\n"
END = "<!-- config-reference:end -->"


def test_the_config_reference_in_docs_matches_the_config_schema():
    generated = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "config_reference.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    text = (REPO / "docs" / "config.md").read_text()
    start = text.index(START) + len(START)
    end = text.index(END)
    assert text[start:end] == generated, "run python scripts/config_reference.py --write"


def test_readme_starts_with_install_main_job_and_tests():
    assert readme_commands()[:3] == [
        'pip install -e ".[dev]"',
        "megatronish train --config configs/tiny.yaml",
        "pytest",
    ]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def _readme_outputs() -> list[str]:
    """The relative paths the example commands of the README and docs/ write (--output,
    --calibration)."""
    paths = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            if line.startswith("    megatronish "):
                paths += re.findall(r"--(?:output|calibration) ([^\s\]]+)", line)
    return [p for p in paths if not p.startswith(("/", "runs/"))]  # runs/: ignored as a whole


@pytest.mark.skipif(_git("rev-parse").returncode != 0, reason="not a git checkout")
def test_the_readme_examples_outputs_are_ignored_and_no_tracked_file_is():
    outputs = _readme_outputs()
    assert {"data/stdlib", "ckpt-tp4", "hf-tiny", "merged.json"} <= set(outputs)
    for path in [*outputs, "runs/tiny"]:
        assert _git("check-ignore", "-q", "--no-index", path).returncode == 0, path
    for kept in ["megatronish/data/loader.py", "tests/fixtures", "megatronish/hf/exporter.py"]:
        assert _git("check-ignore", "-q", "--no-index", kept).returncode == 1, kept
    ignored = _git("ls-files", "--cached", "--ignored", "--exclude-standard").stdout
    assert ignored == "", f"tracked files that .gitignore covers: {ignored}"


def test_every_shipped_config_has_a_row_in_the_table_of_docs_config_md():
    text = (REPO / "docs" / "config.md").read_text()
    table = text[text.index("## The shipped configs") : text.index("## Config reference")]
    rows = set(re.findall(r"^\| `(configs/[^`]+)` \|", table, flags=re.MULTILINE))
    shipped = {f"configs/{path.name}" for path in (REPO / "configs").iterdir()}
    assert shipped - rows == set(), "add these to docs/config.md's table of shipped configs"
    assert rows - shipped == set(), "docs/config.md's table names configs that are not shipped"

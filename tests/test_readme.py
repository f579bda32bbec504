"""The README and the config reference stay true: the README's three commands come first, and
the config reference in docs/config.md is the one generated from megatronish/config/schema.py."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

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
    assert text[start:end] == generated, (
        "run scripts/config_reference.py and paste its output into docs/config.md"
    )


def test_readme_starts_with_install_main_job_and_tests():
    lines = [line.strip() for line in (REPO / "README.md").read_text().splitlines()]
    commands = [
        line.split("#")[0].strip()
        for line in lines
        if line.startswith(("pip ", "megatronish ", "pytest"))
    ]
    assert commands[:3] == [
        'pip install -e ".[dev]"',
        "megatronish train --config configs/tiny.yaml",
        "pytest",
    ]

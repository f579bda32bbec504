"""The README stays true: its three commands come first, and its config reference is the one
generated from megatronish/config.py."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_readme_config_reference_matches_the_config_module():
    generated = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "config_reference.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    readme = (REPO / "README.md").read_text()
    start = readme.index("<!-- config-reference:start -->\n") + len(
        "<!-- config-reference:start -->\n"
    )
    end = readme.index("<!-- config-reference:end -->")
    assert readme[start:end] == generated, "run scripts/config_reference.py and paste its output"


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

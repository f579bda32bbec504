"""scripts/same_results.py on its cheapest entries (a one-process two-step run and one `check`):
compare on the unchanged tree is clean, and an edited record is reported line by line. The
script's commands are forked from the rank fork server (tests/forked.py) rather than started
as fresh interpreters: what they record is the same in either, and an interpreter's start-up
is not what the script compares."""

from __future__ import annotations

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from tests.forked import fork_run

pytestmark = pytest.mark.slow  # the CLI end to end: training and `check` in processes of their own

SCRIPT = REPO / "scripts" / "same_results.py"
ENTRIES = ["smoke", "check tiny.yaml"]
TIMEOUT = 300  # seconds any one command may take before the test fails


def _load_script():
    spec = importlib.util.spec_from_file_location("same_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def forked_run(command: list[str], cwd, env, capture_output: bool, text: bool):
    """subprocess.run as the script calls it (output captured, as text), the command forked."""
    assert capture_output and text, "the script reads the output as text"
    return fork_run(command, TIMEOUT, cwd=cwd, env=env)


def test_compare_is_clean_on_an_unchanged_tree_and_reports_an_edited_record(
    tmp_path, capsys, monkeypatch
):
    script = _load_script()
    monkeypatch.setattr(script, "subprocess", SimpleNamespace(run=forked_run))  # its only use
    record = tmp_path / "record.json"
    assert script.main(["record", str(record), "--only", *ENTRIES]) == 0
    values = json.loads(record.read_text())
    assert values["smoke"]["exit"] == 0 and values["check tiny.yaml"]["exit"] == 0
    assert float.fromhex(values["smoke"]["step 2 loss"]) > 0
    assert any(what.startswith("weights ") for what in values["smoke"])
    capsys.readouterr()

    assert script.main(["compare", str(record), "--only", *ENTRIES]) == 0
    assert capsys.readouterr().out == ""

    edited = json.loads(record.read_text())
    loss = edited["smoke"]["step 1 loss"]
    edited["smoke"]["step 1 loss"] = (float.fromhex(loss) * 2).hex()
    edited["check tiny.yaml"]["stdout"] += "changed\n"
    record.write_text(json.dumps(edited))
    assert script.main(["compare", str(record), "--only", "check tiny.yaml"]) == 1
    lines = capsys.readouterr().out.splitlines()
    stdout = values["check tiny.yaml"]["stdout"].splitlines() + ["<end>"]
    assert lines == [f'check tiny.yaml | stdout line {len(stdout)} | "changed" | "<end>"']
    found = script.differences(edited, values)
    assert ("smoke", "step 1 loss", edited["smoke"]["step 1 loss"], loss) in found
    assert len(found) == 2

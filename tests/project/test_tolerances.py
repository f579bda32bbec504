"""Every bound a test compares numbers to is a name from tests/tolerances.py, where its
derivation is written: a number given as atol=, rtol=, abs= or rel= (or as a "rtol"/"atol"
key of a keyword dict) anywhere else in tests/ fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

TESTS = REPO / "tests"
KEYWORDS = {"atol", "rtol", "abs", "rel"}


def _is_number(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def literal_tolerances(path: Path) -> list[int]:
    """The lines of `path` that give a tolerance keyword a number."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.keyword) and node.arg in KEYWORDS and _is_number(node.value):
            lines.append(node.value.lineno)
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                named = isinstance(key, ast.Constant) and key.value in KEYWORDS
                if named and _is_number(value):
                    lines.append(value.lineno)
    return sorted(lines)


def test_no_test_module_outside_tolerances_gives_a_tolerance_as_a_literal_number():
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        if path != TESTS / "tolerances.py"
        for line in literal_tolerances(path)
    ]
    assert not found, (
        "literal tolerances (use a name from tests/tolerances.py, with its derivation there): "
        + ", ".join(found)
    )


def test_the_check_finds_a_literal_keyword_and_dict_tolerance(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text(
        "assert x == pytest.approx(y, rel=1e-6)\n"
        "torch.testing.assert_close(a, b, **{'rtol': 0, 'atol': -1})\n"
        "assert x == pytest.approx(y, rel=FP32_REORDER, abs=EXACT)\n"
    )
    assert literal_tolerances(path) == [1, 2, 2]

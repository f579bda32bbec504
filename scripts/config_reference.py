"""Prints the config reference of docs/config.md (a Markdown table per section) from the field
declarations and docstrings in megatronish/config/schema.py, so the two never disagree.

    python scripts/config_reference.py
"""

from __future__ import annotations

import ast
import keyword
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "megatronish" / "config" / "schema.py"
SECTIONS = {
    "ModelConfig": "model",
    "RopeScalingConfig": "model.rope_scaling",
    "MoEConfig": "model.moe",
    "ParallelConfig": "parallel",
    "TrainConfig": "train",
    "OptimConfig": "optim",
    "DataConfig": "data",
    "CheckpointConfig": "checkpoint",
    "KernelsConfig": "kernels",
    "ObserveConfig": "observe",
    "RunConfig": "run",
}


def reference() -> str:
    tree = ast.parse(SOURCE.read_text())
    out = []
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name in SECTIONS):
            continue
        section = SECTIONS[node.name]
        out += [f"**{section}**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        body = node.body
        for i, stmt in enumerate(body):
            if not isinstance(stmt, ast.AnnAssign):
                continue
            doc = ""
            if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr):
                value = body[i + 1].value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    doc = " ".join(value.value.split())
            kind = ast.unparse(stmt.annotation).replace("|", "\\|")
            default = ast.unparse(stmt.value) if stmt.value is not None else ""
            name = stmt.target.id  # a Python keyword's field takes a `_`: `async_` is `async`
            key = f"{section}.{name[:-1] if keyword.iskeyword(name[:-1]) else name}"
            out.append(f"| `{key}` | `{kind}` | `{default}` | {doc.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(reference(), end="")

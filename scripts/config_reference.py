"""Prints the config reference of docs/config.md (a Markdown table per section) from the field
declarations and docstrings in megatronish/config/ (model_schema.py, lora.py, schema.py), so the two
never disagree; `--write` puts it into docs/config.md between its markers.

    python scripts/config_reference.py [--write]
"""

from __future__ import annotations

import ast
import keyword
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [
    ROOT / "megatronish" / "config" / name for name in ("model_schema.py", "lora.py", "schema.py")
]
DOCS = ROOT / "docs" / "config.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
SECTIONS = {
    "ModelConfig": "model",
    "RopeScalingConfig": "model.rope_scaling",
    "MoEConfig": "model.moe",
    "MLAConfig": "model.mla",
    "LoraConfig": "model.lora",
    "ParallelConfig": "parallel",
    "TrainConfig": "train",
    "DPOConfig": "train.dpo",
    "OptimConfig": "optim",
    "MuonConfig": "optim.muon",
    "DataConfig": "data",
    "CheckpointConfig": "checkpoint",
    "KernelsConfig": "kernels",
    "ObserveConfig": "observe",
    "RunConfig": "run",
    "RLConfig": "rl",
}


def reference() -> str:
    nodes = [node for source in SOURCES for node in ast.parse(source.read_text()).body]
    out = []
    for node in nodes:
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


def write_docs() -> None:
    """Replaces what lies between docs/config.md's markers with the reference."""
    text = DOCS.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    DOCS.write_text(text[:start] + reference() + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_docs()
    else:
        print(reference(), end="")

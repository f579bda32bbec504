"""The docs stay true: every command block of README.md and docs/*.md marked runnable runs as
written, and every relative link in them points to a file, and a heading, that exist.

A runnable block is a code block (indented or fenced) with `<!-- runnable -->` on its own line
before it, blank lines between allowed; `<!-- runnable: exit N -->` expects exit status N, and
for N != 0 one line on stderr. Each command of a block (a trailing backslash continues a line;
a `#` comment is dropped) runs as written: `megatronish ...` in this process (invoke_cli: the
command group with those arguments, its exit status, stdout and stderr, no interpreter and
torch import of its own) and `python ...` in a subprocess with this interpreter, this checkout
first on PYTHONPATH. The blocks of one file run in order, in one temporary working directory
that holds links to the repository's configs/, docs/ and scripts/: an example names
`configs/tiny.yaml` as a user in the repository root does, and what it writes (`runs/...`,
`data/...`) lands in the temporary directory, so a later block of the file can read what an
earlier one wrote; the files run one after the other. Only cheap one-process commands are
marked (see docs/testing.md).

A reader runs the README's main job before anything else, so the blocks run after it too: each
file's directory starts with the runs/ that the README's main job wrote, run once as written but
for its number of steps (MAIN_JOB_STEPS)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, finish, invoke_cli, link_checkout, start

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*runnable(?::\s*exit\s+(\d+))?\s*-->")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND_TIMEOUT_S = 120
# The main job as the README gives it, stopped at this step (its 200 take half a minute of the
# suite): what the blocks read of it is runs/tiny and the checkpoint of its model there, which a
# reader's has too, and no block trains configs/tiny.yaml for more steps than this. Its last
# step logs (train.log_every 10), evaluates and saves, as the 200th does: every code path of the
# whole job.
MAIN_JOB_STEPS = 10


@dataclass(frozen=True)
class Block:
    """A runnable block: where its marker is, its commands (empty when the marker is not
    followed by a code block) and the exit status each command must have."""

    path: Path
    line: int
    commands: tuple[str, ...]
    exit_status: int


def _code_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The lines of the code block starting at lines[i] (fenced, or indented by four spaces,
    dedented), and the index after it; no lines when none starts there."""
    if i < len(lines) and FENCE.match(lines[i]):
        fence, body, i = lines[i][:3], [], i + 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        return body, i + 1
    body = []
    while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
        body.append(lines[i][4:])
        i += 1
    return body, i


def _commands(body: list[str]) -> tuple[str, ...]:
    """The command lines of a code block, a trailing backslash joining a line to the next."""
    commands, pending = [], ""
    for line in body:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
        elif pending or line.strip():
            commands.append(pending + line.strip())
            pending = ""
    return tuple(commands)


def runnable_blocks(path: Path) -> list[Block]:
    """Every block of a Markdown file marked runnable, in the order of the file."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        marker = MARKER.fullmatch(lines[i].strip())
        if marker is None:
            i += 1
            continue
        at = i + 1
        while at < len(lines) and not lines[at].strip():
            at += 1
        body, end = _code_block(lines, at)
        blocks.append(Block(path, i + 1, _commands(body), int(marker.group(1) or 0)))
        i = max(end, i + 1)
    return blocks


@contextlib.contextmanager
def _working_directory(cwd: Path):
    before = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)


def _words(command: str) -> list[str]:
    """The words of a documented command as a shell splits them, a `#` comment dropped."""
    return shlex.split(command, comments=True)


def _run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A documented command run in cwd: `megatronish ...` in this process, `python ...` in a
    subprocess with this interpreter and env."""
    words = _words(command)
    if words[0] == "megatronish":
        with _working_directory(cwd):
            return invoke_cli(*words[1:])
    if words[0] == "python":
        return finish(start([sys.executable, *words[1:]], env, cwd=cwd), COMMAND_TIMEOUT_S)
    raise AssertionError(f"{command!r}: only megatronish and python commands can be runnable")


def _prose(text: str) -> list[str]:
    """The lines of a Markdown text outside code blocks (code lines are left empty, so line
    numbers and the text around links stay)."""
    out, fence, previous_blank = [], None, True
    for line in text.splitlines():
        if fence is not None:
            fence = None if line.startswith(fence) else fence
            out.append("")
        elif FENCE.match(line):
            fence = line[:3]
            out.append("")
        elif line.startswith("    ") and previous_blank:
            out.append("")  # an indented code line: stays "blank" for the next one
            continue
        else:
            out.append(line)
        previous_blank = not out[-1].strip()
    return out


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation but
    `-` and `_` dropped, spaces as `-`, a repeated anchor numbered -1, -2, ..."""
    anchors: set[str] = set()
    for line in _prose(path.read_text()):
        heading = HEADING.match(line)
        if heading is None:
            continue
        anchor = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        numbered, n = anchor, 0
        while numbered in anchors:
            n += 1
            numbered = f"{anchor}-{n}"
        anchors.add(numbered)
    return anchors


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file, or heading, does not exist."""
    text = re.sub(r"`[^`]*`", "", "\n".join(_prose(path.read_text())))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked):
            broken.append(f"{target} (no such heading)")
    return broken


def readme_commands() -> list[str]:
    """The README's commands (pip, megatronish and pytest lines), comments dropped, in order:
    its first three are the install, the main job and the tests."""
    lines = [line.strip() for line in (REPO / "README.md").read_text().splitlines()]
    starts = ("pip ", "megatronish ", "pytest")
    return [line.split("#")[0].strip() for line in lines if line.startswith(starts)]


def _run_blocks(doc: Path, cwd: Path, env: dict[str, str]) -> str | None:
    """Runs the runnable blocks of doc in order in cwd; the first failure, or None."""
    for block in runnable_blocks(doc):
        if not block.commands:
            return f"{doc.name}:{block.line}: the marker marks no code block"
        for command in block.commands:
            done = _run(command, cwd, env)
            where = f"{doc.name}:{block.line}: {command}"
            if done.returncode != block.exit_status:
                return f"{where}: exit {done.returncode}, not {block.exit_status}\n{done.stderr}"
            if block.exit_status and len(done.stderr.splitlines()) != 1:
                return f"{where}: not one line on stderr\n{done.stderr}"
    return None


@pytest.mark.slow  # every runnable example of the docs, as written
def test_the_runnable_blocks_of_every_doc_run_as_written_after_the_main_job(tmp_path):
    """Each file's blocks in a directory of its own that holds the main job's runs/, one file
    after the other."""
    docs = [doc for doc in DOCS if runnable_blocks(doc)]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    main_job = link_checkout(tmp_path / "main-job")
    done = _run(f"{readme_commands()[1]} --set train.steps={MAIN_JOB_STEPS}", main_job, env)
    assert done.returncode == 0, f"the README's main job: {done.stderr}"
    failures = []
    for doc in docs:
        cwd = link_checkout(tmp_path / doc.stem)
        shutil.copytree(main_job / "runs", cwd / "runs")
        failures.append(_run_blocks(doc, cwd, env))
    assert not any(failures), "\n\n".join(f for f in failures if f)


def test_every_runnable_marker_marks_a_code_block():
    blocks = [block for path in DOCS for block in runnable_blocks(path)]
    assert blocks, "no runnable block in README.md or docs/"
    empty = [f"{b.path.name}:{b.line}" for b in blocks if not b.commands]
    assert not empty, f"runnable markers without a code block: {', '.join(empty)}"


def test_every_relative_link_of_the_docs_resolves():
    broken = [f"{path.name}: {link}" for path in DOCS for link in broken_links(path)]
    assert not broken, "broken links: " + "; ".join(broken)


def test_the_block_reader_takes_fenced_and_indented_blocks_continuations_and_exit_status(
    tmp_path,
):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Text.\n\n<!-- runnable -->\n\n    megatronish check --config a.yaml \\\n"
        "        --world-size 2\n\n    megatronish plan --config a.yaml  # a comment\n\n"
        "Prose.\n\n    megatronish unmarked\n\n<!-- runnable: exit 2 -->\n```sh\n"
        "megatronish check --config missing.yaml\n```\n\n<!-- runnable -->\n\nProse only.\n"
    )
    blocks = runnable_blocks(doc)
    assert [(b.line, b.commands, b.exit_status) for b in blocks] == [
        (
            3,
            (
                "megatronish check --config a.yaml --world-size 2",
                "megatronish plan --config a.yaml  # a comment",
            ),
            0,
        ),
        (14, ("megatronish check --config missing.yaml",), 2),
        (19, (), 0),
    ]
    assert _words(blocks[0].commands[1]) == ["megatronish", "plan", "--config", "a.yaml"]


def test_the_link_check_names_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A `code`, heading\n\n## Twice\n\n## Twice\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#a-code-heading), [ok](other.md#twice-1), [ok](#doc),\n"
        "[a link\nover two lines](other.md#nowhere), [web](https://example.com/x),\n"
        "`[in code](missing.md)`, [gone](missing.md).\n\n    [in a code block](missing.md)\n"
    )
    assert broken_links(doc) == ["other.md#nowhere (no such heading)", "missing.md (no such file)"]

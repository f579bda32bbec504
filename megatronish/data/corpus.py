"""The documents of a corpus: files, directories, JSON Lines files, or the built-in corpus
(the Python standard library's own .py sources).

A corpus is iterated as *pieces* `(text, ends_document, counted)`: a file or a JSON Lines
record is one document; a file larger than READ_CHUNK bytes comes in several pieces (cut after
a newline), so memory stays bounded by the chunk size, not by the largest file. `counted`
(whether the piece's tokens count in the loss) is always true here; an SFT corpus (sft.py) has
pieces that are not.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatronish.errors import UserError

READ_CHUNK = 16 << 20  # bytes of a file decoded at a time
SNIFF_BYTES = 8192  # a NUL byte among the first SNIFF_BYTES marks a binary file
# Directories of the standard library left out of the built-in corpus: installed packages,
# test suites (some files there are deliberately not valid UTF-8) and byte-code caches.
BUILTIN_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@dataclass(frozen=True)
class Source:
    """One input file. `explicit`: named by the user (a file that is not text is an error);
    otherwise found in a directory (a file that is not text is skipped)."""

    path: Path
    explicit: bool

    @property
    def jsonl(self) -> bool:
        return self.path.suffix.lower() == ".jsonl"


@dataclass
class Corpus:
    """Sources in a fixed order plus what a pass over them counted (reset on every pass)."""

    sources: list[Source]
    description: list[str]  # the inputs as given (absolute), or the stdlib directory
    is_builtin: bool = False
    jsonl_field: str = "text"
    text_bytes: int = 0  # UTF-8 bytes of document text seen by the last pass
    skipped_files: list[str] = field(default_factory=list)

    @classmethod
    def from_inputs(
        cls, inputs: list[str], glob_pattern: str | None = None, jsonl_field: str = "text"
    ) -> Corpus:
        """Expands files and directories (recursively, sorted; with glob_pattern, only matching
        files; hidden files and directories are left out). UserError for a missing path or a
        directory with no candidate files."""
        sources: list[Source] = []
        seen: set[Path] = set()
        for raw in inputs:
            path = Path(raw).expanduser()
            if not path.exists():
                raise UserError(f"{raw}: input path does not exist")
            if path.is_dir():
                found = _walk(path, glob_pattern)
                if not found:
                    what = f" matching --glob '{glob_pattern}'" if glob_pattern else ""
                    raise UserError(f"{raw}: input directory has no files{what}")
                new = [Source(p, explicit=False) for p in found]
            elif path.is_file():
                new = [Source(path, explicit=True)]
            else:
                raise UserError(f"{raw}: input is neither a regular file nor a directory")
            for source in new:
                key = source.path.resolve()
                if key not in seen:
                    seen.add(key)
                    sources.append(source)
        description = [str(Path(raw).expanduser().resolve()) for raw in inputs]
        return cls(sources, description, jsonl_field=jsonl_field)

    @classmethod
    def builtin(cls) -> Corpus:
        """The running interpreter's standard library .py files, in sorted order."""
        root, files = builtin_files()
        return cls([Source(p, explicit=False) for p in files], [str(root)], is_builtin=True)

    def pieces(self) -> Iterator[tuple[str, bool, bool]]:
        """Yields (text, ends_document, counted); empty documents are left out."""
        self.text_bytes = 0
        self.skipped_files = []
        for source in self.sources:
            if source.jsonl:
                yield from self._jsonl_pieces(source.path)
            else:
                yield from self._file_pieces(source)

    def texts(self) -> Iterator[str]:
        """The text of every piece (for tokenizer training)."""
        for text, _, _ in self.pieces():
            yield text

    def _file_pieces(self, source: Source) -> Iterator[tuple[str, bool, bool]]:
        path = source.path
        try:
            handle = open(path, "rb")
        except OSError as exc:
            raise UserError(f"{path}: cannot read input file ({exc.strerror})") from None
        with handle:
            data = handle.read(READ_CHUNK)
            complete = len(data) < READ_CHUNK
            if b"\0" in data[:SNIFF_BYTES] or not _is_utf8_prefix(data, complete):
                if source.explicit:
                    raise UserError(f"{path}: binary file, not UTF-8 text")
                self.skipped_files.append(str(path))
                return
            offset = 0
            while data:
                more = handle.read(READ_CHUNK) if len(data) >= READ_CHUNK else b""
                if more:
                    cut = _cut_point(data)
                    data, carry = data[:cut], data[cut:] + more
                else:
                    carry = b""
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    if offset == 0 and not carry and not source.explicit:
                        self.skipped_files.append(str(path))
                        return
                    raise UserError(
                        f"{path}: not UTF-8 text (invalid byte at offset {offset + exc.start})"
                    ) from None
                offset += len(data)
                self.text_bytes += len(data)
                yield text, not carry, True
                data = carry

    def _jsonl_pieces(self, path: Path) -> Iterator[tuple[str, bool, bool]]:
        field_name = self.jsonl_field
        for lineno, record in jsonl_records(path):
            if field_name not in record:
                fields = ", ".join(sorted(record)) or "none"
                raise UserError(
                    f"{path}:{lineno}: record has no field '{field_name}' "
                    f"(its fields: {fields}); choose one with --jsonl-field"
                )
            text = record[field_name]
            if not isinstance(text, str):
                kind = type(text).__name__
                raise UserError(f"{path}:{lineno}: field '{field_name}' is {kind}, not a string")
            if text:
                self.text_bytes += len(text.encode("utf-8"))
                yield text, True, True


def jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a JSON Lines file; UserError naming
    path:line for a line that is not a JSON object."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot read input file ({exc.strerror})") from None
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                raise UserError(f"{path}:{lineno}: not a JSON Lines record ({reason})") from None
            if not isinstance(record, dict):
                kind = type(record).__name__
                raise UserError(
                    f"{path}:{lineno}: a JSON Lines record must be an object, not {kind}"
                )
            yield lineno, record


def builtin_files() -> tuple[Path, list[Path]]:
    """The standard library directory and its .py files (sorted by relative path), without
    installed packages, test suites and caches."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in BUILTIN_EXCLUDED_DIRS and d[0] != "."]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return root, files


def _walk(directory: Path, glob_pattern: str | None) -> list[Path]:
    """Regular files under directory (not hidden), sorted by relative path; with a pattern, only
    those whose name (or, for a pattern with '/', relative path) matches it."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            path = Path(dirpath, name)
            if glob_pattern is not None:
                target = path.relative_to(directory).as_posix() if "/" in glob_pattern else name
                if not fnmatch.fnmatch(target, glob_pattern):
                    continue
            if path.is_file():
                found.append(path)
    found.sort(key=lambda p: p.relative_to(directory).as_posix())
    return found


def _is_utf8_prefix(data: bytes, complete: bool) -> bool:
    """Whether the first SNIFF_BYTES bytes are UTF-8; unless `data` is the complete file, a
    character cut off at the end of that prefix is allowed."""
    head = data[:SNIFF_BYTES]
    complete = complete and len(data) <= SNIFF_BYTES
    for trim in range(1 if complete else 4):
        try:
            head[: len(head) - trim].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def _cut_point(data: bytes) -> int:
    """Where to cut a chunk so that no UTF-8 character is split: after the last newline, or
    else before the last character's lead byte."""
    newline = data.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    cut = len(data)
    while cut > len(data) - 4 and cut > 0 and (data[cut - 1] & 0xC0) == 0x80:
        cut -= 1
    if cut > 0 and data[cut - 1] >= 0xC0:  # a lead byte whose continuation bytes are cut off
        cut -= 1
    return cut if cut > 0 else len(data)

"""Preference pairs for DPO (`prepare --preference`): JSON Lines records -> two conversations
that share the prompt, the chosen response's and the rejected one's.

A record is {"messages": [...the prompt's turns...], "chosen": TEXT, "rejected": TEXT}, or
{"prompt": TEXT, "chosen": ..., "rejected": ...} (the prompt a single user turn). Each response
becomes the assistant's message after the prompt's turns, and the conversation is rendered and
marked as an SFT example is (sft.py with the built-in template, template_sft.py with a
tokenizer directory's own), except that only the response counts: assistant turns inside the
prompt do not.

The dataset's documents are the pairs' conversations in order, the chosen one of pair k at
document 2k and the rejected one at 2k + 1; the train/validation split draws whole pairs.
records.npy (int64 [n_pairs, 2]: the input's index in metadata "preference"["inputs"], the
record's line) names each pair's record for the messages of training.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megatronish.data.corpus import jsonl_records
from megatronish.data.sft import SFTCorpus, messages_of
from megatronish.errors import UserError

RECORDS_FILE = "records.npy"
RECORD_SHAPE = "a preference record has 'chosen', 'rejected' and 'messages' or 'prompt'"
RESPONSES = ("chosen", "rejected")


def pair_of(record: dict[str, Any], where: str) -> tuple[list[dict[str, str]], ...]:
    """The two conversations (chosen, rejected) of a preference record; UserError naming
    `where` (file:line) and what would be valid for a field missing, empty or not a string,
    or a prompt of neither shape."""
    for key in RESPONSES:
        if key not in record:
            fields = ", ".join(sorted(record)) or "none"
            raise UserError(
                f"{where}: record has no field '{key}' (its fields: {fields}); {RECORD_SHAPE}"
            )
        if not isinstance(record[key], str) or not record[key].strip():
            raise UserError(f"{where}: field '{key}' must be a non-empty string (the response)")
    if ("messages" in record) == ("prompt" in record):
        raise UserError(
            f"{where}: record needs exactly one of 'messages' and 'prompt'; {RECORD_SHAPE}"
        )
    if "prompt" in record:
        prompt = {"prompt": record["prompt"], "response": record["chosen"]}
        turns = messages_of(prompt, where)[:-1]
    else:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise UserError(f"{where}: field 'messages' must be a list of {{role, content}}")
        last = {"role": "assistant", "content": record["chosen"]}
        turns = messages_of({"messages": [*messages, last]}, where)[:-1]
    return tuple([*turns, {"role": "assistant", "content": record[key]}] for key in RESPONSES)


class PreferenceCorpus(SFTCorpus):
    """A corpus of preference JSON Lines files: each record two documents (see the module
    docstring); `records` lists (input index, line) of every pair read so far."""

    last_turn_only = True

    def conversations(self) -> Iterator[tuple[str, list[dict[str, str]]]]:
        """(where: file:line, messages) of each record's chosen, then rejected conversation."""
        self.skipped_files = []
        self.records: list[tuple[int, int]] = []
        for index, source in enumerate(self.sources):
            for lineno, record in jsonl_records(source.path):
                where = f"{source.path}:{lineno}"
                chosen, rejected = pair_of(record, where)
                self.records.append((index, lineno))
                yield where, chosen
                yield where, rejected

    def write_records(self, directory: Path) -> dict[str, Any]:
        """Writes records.npy into `directory`; returns metadata.json's "preference"."""
        records = np.array(self.records, dtype=np.int64).reshape(-1, 2)
        np.save(directory / RECORDS_FILE, records)
        inputs = [str(source.path) for source in self.sources]
        return {"pairs": len(records), "records": RECORDS_FILE, "inputs": inputs}


def pair_split(n_docs: int, draw) -> np.ndarray:
    """The split flags of a preference dataset's n_docs documents: `draw(n_pairs)` flags one
    per pair, each given to both of its conversations."""
    return np.repeat(draw(n_docs // 2), 2)


def record_name(meta: dict[str, Any], records: np.ndarray, pair: int) -> str:
    """'FILE:LINE' of pair `pair` of a preference dataset (records: its records.npy)."""
    index, line = records[pair]
    return f"{meta['preference']['inputs'][int(index)]}:{int(line)}"

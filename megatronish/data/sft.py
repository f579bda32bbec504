"""Supervised fine-tuning examples: JSON Lines records -> the chat template's text segments,
each marked as counted in the loss or not (`prepare --sft`).

A record is {"prompt": P, "response": R} (the same as the messages [user P, assistant R]) or
{"messages": [{"role": ROLE, "content": TEXT}, ...]} with roles system, user and assistant, the
last message the assistant's. `render` is the template: each message is its role tag on a line
of its own, then its content; messages are separated by a newline; the end-of-text token that
`prepare` puts after every document closes the last response:

    <|system|>\\n{system}\\n<|user|>\\n{prompt}\\n<|assistant|>\\n{response}<|endoftext|>

Only the assistant messages' content and that closing end-of-text token count in the loss; role
tags, separators, system and user content do not. Each segment is tokenized on its own, so the
loss mask follows the segments exactly (a token never straddles a counted and an uncounted
segment).

`prepare --sft --tokenizer DIR` renders with DIR's own chat template instead, where it has one
(template_sft.py); this template stays for the byte tokenizer and tokenizers without one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from megatronish.data.corpus import Corpus, jsonl_records
from megatronish.errors import UserError

ROLES = ("system", "user", "assistant")
RECORD_SHAPES = "an SFT record has 'prompt' and 'response', or 'messages'"


def render(messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The chat template (see the module docstring): messages checked by `messages_of` ->
    [(text, counted)], whose texts joined are the example's text without its end-of-text
    token; counted marks the assistant contents."""
    segments: list[tuple[str, bool]] = []
    prompt = ""  # uncounted text since the last assistant content
    for index, message in enumerate(messages):
        prompt += ("\n" if index else "") + f"<|{message['role']}|>\n"
        if message["role"] == "assistant":
            segments += [(prompt, False), (message["content"], True)]
            prompt = ""
        else:
            prompt += message["content"]
    return segments


def messages_of(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The messages of an SFT record; UserError naming `where` (file:line) and what would be
    valid for a record of neither shape, an unknown role, a field that is not a string, or a
    conversation that does not end with the assistant's message."""
    if "messages" not in record:
        for key in ("prompt", "response"):
            if key not in record:
                fields = ", ".join(sorted(record)) or "none"
                raise UserError(
                    f"{where}: record has no field '{key}' (its fields: {fields}); {RECORD_SHAPES}"
                )
            _require_string(record[key], f"{where}: field '{key}'")
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    if "prompt" in record or "response" in record:
        raise UserError(
            f"{where}: record has both 'messages' and 'prompt'/'response'; {RECORD_SHAPES}"
        )
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(
            f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects"
        )
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise UserError(
                f"{where}: message {number} must be an object with 'role' and 'content'"
            )
        if message["role"] not in ROLES:
            raise UserError(
                f"{where}: message {number} has role {message['role']!r}; valid roles: "
                f"{', '.join(ROLES)}"
            )
        _require_string(message["content"], f"{where}: message {number}'s content")
    if messages[-1]["role"] != "assistant":
        raise UserError(
            f"{where}: the last message has role {messages[-1]['role']!r}; it must be the "
            "assistant's response (the assistant's messages are what the loss counts)"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _require_string(value: Any, what: str) -> None:
    if not isinstance(value, str):
        raise UserError(f"{what} is {type(value).__name__}, not a string")


class SFTCorpus(Corpus):
    """A corpus of SFT JSON Lines files (every input file is read as JSON Lines): each record
    is one document, its pieces the template's segments, (text, ends_document, counted)."""

    last_turn_only: ClassVar[bool] = False
    """Whether only the last assistant message counts in the loss (preference pairs), not
    every one."""

    def conversations(self) -> Iterator[tuple[str, list[dict[str, str]]]]:
        """(where: file:line, the record's messages) for every record, in order."""
        self.skipped_files = []
        for source in self.sources:
            for lineno, record in jsonl_records(source.path):
                where = f"{source.path}:{lineno}"
                yield where, messages_of(record, where)

    def pieces(self) -> Iterator[tuple[str, bool, bool]]:
        self.text_bytes = 0
        for _, messages in self.conversations():
            segments = render(messages)
            if self.last_turn_only:
                segments = [(text, False) for text, _ in segments[:-1]] + segments[-1:]
            for index, (text, counted) in enumerate(segments):
                self.text_bytes += len(text.encode("utf-8"))
                yield text, index == len(segments) - 1, counted

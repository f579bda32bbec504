"""SFT examples rendered by a tokenizer directory's own chat template (`prepare --sft
--tokenizer DIR`; chat_template.py renders it as transformers' apply_chat_template does).

A record's conversation is rendered whole and tokenized whole, adding no special tokens (the
template writes them): its ids are apply_chat_template's, token for token. The tokens counted in
the loss are, for each assistant message i, the tokens of render(messages[:i+1]) past those of
render(messages[:i], add_generation_prompt=True): the message as the template writes it, with
the end-of-turn tokens the template puts after it. Nothing else counts. Each prompt's ids must
begin its turn's, and each turn's the whole conversation's: a template that is not prefix-stable
is a UserError naming the record.

The tokenizer's end-of-text token ends every document: it is appended, uncounted, unless the
template's ids already end with it. A template may write it inside a conversation too (Mistral's
</s> after every assistant message): document masks take an SFT dataset's documents from its
offsets, so the conversation stays one document.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from megatronish.data.chat_template import (
    ChatTemplate,
    load_chat_template,
    read_json_object_or_none,
    template_failure,
)
from megatronish.data.dataset import TOKENIZER_FILE
from megatronish.data.encode import BATCH_PIECES, TokenOutput
from megatronish.data.sft import SFTCorpus
from megatronish.data.tokenizer import HFTokenizer, load_tokenizer_file
from megatronish.errors import UserError

MODEL_CONFIG = "config.json"  # a Hugging Face model directory's config, beside its tokenizer
CHECKPOINT_CONFIG = "config.yaml"  # a checkpoint step directory's (`import` puts one there)


def load_tokenizer_dir(directory: Path) -> tuple[HFTokenizer, ChatTemplate | None, int | None]:
    """(the tokenizer of a Hugging Face tokenizer directory, its chat template or None, the
    vocab_size of the model beside it or None): a model's embedding may have more rows than its
    tokenizer has tokens. The model is a Hugging Face directory's config.json or a checkpoint
    step directory's config.yaml. UserError naming the directory without a tokenizer.json."""
    if not (directory / TOKENIZER_FILE).is_file():
        raise UserError(
            f"--tokenizer {directory}: a tokenizer directory needs {TOKENIZER_FILE} (and, for "
            "its chat template, chat_template.jinja or tokenizer_config.json)"
        )
    tok = load_tokenizer_file(directory / TOKENIZER_FILE)
    return tok, load_chat_template(directory), _model_vocab_size(directory)


def _model_vocab_size(directory: Path) -> int | None:
    size = read_json_object_or_none(directory / MODEL_CONFIG).get("vocab_size")
    checkpoint_config = directory / CHECKPOINT_CONFIG
    if size is None and checkpoint_config.is_file():
        try:
            config = yaml.safe_load(checkpoint_config.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError):
            config = None
        model = config.get("model") if isinstance(config, dict) else None
        size = model.get("vocab_size") if isinstance(model, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def conversation_ids(
    template: ChatTemplate,
    tok: HFTokenizer,
    messages: list[dict[str, str]],
    where: str,
    last_turn_only: bool = False,
) -> tuple[list[int], np.ndarray]:
    """(the conversation's ids, uint8 loss mask [len(ids)]: 1 where the rule above counts the
    token, with last_turn_only for the last assistant message alone); UserError naming `where`
    for a template that fails on it or is not prefix-stable."""
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    turns = turns[-1:] if last_turn_only else turns
    texts = [_render(template, messages, False, where)]
    for i in turns:
        texts += [
            _render(template, messages[:i], True, where),
            _render(template, messages[: i + 1], False, where),
        ]
    unique = list(dict.fromkeys(texts))  # the last turn's render is the conversation's
    by_text = dict(zip(unique, tok.encode_batch(unique), strict=True))
    encoded = [by_text[text] for text in texts]
    ids = encoded[0]
    mask = np.zeros(len(ids), dtype=np.uint8)
    for number, i in enumerate(turns):
        prompt, turn = encoded[1 + 2 * number], encoded[2 + 2 * number]
        if turn[: len(prompt)] != prompt or ids[: len(turn)] != turn:
            raise UserError(
                f"{where}: the chat template {template.name} is not prefix-stable: rendering "
                f"message {i + 1} (the assistant's) changes the tokens before it, so its tokens "
                "cannot be told apart (each prompt, with its generation prompt, must begin the "
                "conversation that follows it)"
            )
        mask[len(prompt) : len(turn)] = 1
    return ids, mask


def _render(
    template: ChatTemplate, messages: list[dict[str, str]], generation: bool, where: str
) -> str:
    try:
        return template.render(messages, add_generation_prompt=generation)
    except Exception as exc:  # a template can raise anything; each is the record's failure
        raise template_failure(template, where, exc) from None


def encode_conversations(
    corpus: SFTCorpus,
    template: ChatTemplate,
    tok: HFTokenizer,
    path: Path,
    dtype: np.dtype,
    mask_path: Path,
) -> tuple[np.ndarray, int, str, int]:
    """Writes every record's ids to `path` and their loss mask to `mask_path`, each document
    ended by the end-of-text token (see the module docstring); returns (offsets int64
    [n_docs + 1], the largest id, sha256 of the ids, tokens counted). Sets corpus.text_bytes."""
    corpus.text_bytes = 0
    with TokenOutput.open(path, mask_path, tok) as out:
        parts: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        end = 0
        for where, messages in corpus.conversations():
            ids, mask = conversation_ids(template, tok, messages, where, corpus.last_turn_only)
            if not ids:
                raise UserError(f"{where}: the chat template {template.name} renders nothing")
            corpus.text_bytes += sum(len(m["content"].encode("utf-8")) for m in messages)
            if ids[-1] != tok.eot_id:
                ids, mask = [*ids, tok.eot_id], np.append(mask, np.uint8(0))
            parts.append(np.array(ids, dtype=dtype))
            masks.append(mask)
            end += len(ids)
            out.document_ends.append(end)
            if len(parts) >= BATCH_PIECES:
                out.append(np.concatenate(parts), masks)
                parts, masks = [], []
        if parts:
            out.append(np.concatenate(parts), masks)
    return out.result()

"""A Hugging Face tokenizer directory's own chat template, rendered as transformers'
`apply_chat_template` renders it: the same Jinja settings (trim_blocks, lstrip_blocks, the
loopcontrols extension, a `{% generation %}` block that renders its body), the same globals
(raise_exception, strftime_now, dict, namespace), the same tojson filter (no HTML escaping) and
the same variables (messages, tools=None, documents=None, add_generation_prompt and the named
special tokens of tokenizer_config.json: bos_token, eos_token, ...).

A template is code from whoever published the model, so it renders in Jinja's immutable
sandbox, stricter still: reaching an object's internals (an attribute starting with an
underscore, such as __class__ or __globals__), an unsafe callable or another template (import,
include, extends) raises SecurityError at once, which `render` reports as a UserError naming the
template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megatronish.errors import UserError, read_json_object

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The named special tokens a template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class _NoTemplates(jinja2.BaseLoader):
    """Refuses every template a chat template asks for (import, include, extends)."""

    def get_source(self, environment: jinja2.Environment, template: str) -> Any:
        raise SecurityError(f"a chat template may not load another template ({template!r})")


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, where an unsafe attribute raises at once instead of rendering
    as an undefined value."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe"
        )


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace(), refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace attribute may not start with an underscore ({name!r})")


class _Dict:
    """dict() and dict.fromkeys() for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def sandbox() -> jinja2.Environment:
    """The environment chat templates compile in (see the module docstring)."""
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
        loader=_NoTemplates(),
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
    )
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template; `name` is the file it came from, as messages name it."""

    name: str
    source: str
    special_tokens: dict[str, str]
    compiled: jinja2.Template

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation as the template writes it. TemplateError (the template's own
        raise_exception, or any failure) and SecurityError pass through: the caller names the
        record."""
        return self.compiled.render(
            messages=[dict(message) for message in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )


def template_failure(template: ChatTemplate, where: str, exc: Exception) -> UserError:
    """The UserError for a template that failed to render the record at `where`: one naming
    the template when it reached outside its sandbox, else one naming the record and the
    template's error."""
    reason = " ".join(str(exc).split())[:300] or type(exc).__name__
    if isinstance(exc, SecurityError):
        return UserError(
            f"{template.name}: the chat template reaches outside its sandbox ({reason}); "
            "refused: a template may only format the messages it is given"
        )
    return UserError(f"{where}: the chat template {template.name} fails on this record: {reason}")


def load_chat_template(directory: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face tokenizer directory: chat_template.jinja, else
    tokenizer_config.json's chat_template (a string, or a list of {name, template} of which
    "default" is taken); None when it has neither. UserError naming the file for one that does
    not parse."""
    config = read_json_object_or_none(directory / TOKENIZER_CONFIG)
    jinja_file = directory / TEMPLATE_FILE
    if jinja_file.is_file():
        source, name = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    else:
        name = f"{directory / TOKENIZER_CONFIG} (chat_template)"
        source = _configured_template(config.get("chat_template"), name)
        if source is None:
            return None
    try:
        compiled = sandbox().from_string(source)
    except TemplateError as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise UserError(f"{name}: the chat template does not parse{where}: {exc}") from None
    return ChatTemplate(name, source, _special_tokens(directory, config), compiled)


def _configured_template(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        shown = ", ".join(sorted(str(n) for n in named)) or "none"
        raise UserError(f"{name}: no template named 'default' among the templates ({shown})")
    raise UserError(f"{name}: must be a string or a list of {{name, template}} objects")


def _special_tokens(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens as text (special_tokens_map.json, then tokenizer_config.json,
    whose entries win); a token may be written as a string or as {"content": ...}."""
    tokens: dict[str, str] = {}
    for source in (read_json_object_or_none(directory / SPECIAL_TOKENS_MAP), config):
        for key in SPECIAL_TOKEN_NAMES:
            value = source.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
    return tokens


def read_json_object_or_none(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when there is no such file. UserError naming it otherwise."""
    return read_json_object(path, "") if path.is_file() else {}

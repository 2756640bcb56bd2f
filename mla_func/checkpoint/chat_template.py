"""Chat templates: OpenAI-style messages to a model's prompt text, written by the checkpoint's own Jinja template.

A Hugging Face checkpoint carries its template in tokenizer_config.json (`chat_template`: a string, or a
list of {"name", "template"} of which "default" is used) or, in newer exports, as chat_template.jinja
beside it, which wins, as it does in transformers. It is rendered the way transformers'
`apply_chat_template` renders it, so that the same messages give the same text: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, a `raise_exception(message)`
helper, a `tojson` that does not escape HTML, `strftime_now(format)`, and the variables `messages`,
`add_generation_prompt` and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...).

The rendered text holds the template's own special tokens (a beginning-of-sequence token, role
markers): tokenize it without the tokenizer's added special tokens, as transformers does for a chat.

Only this module knows Jinja. It sits in the checkpoint layer, below `core`, so that `core.model.Model`
can carry a template and `serving` can render one without either importing the other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

from mla_func.checkpoint.files import CheckpointError, CheckpointFolder

ROLES = ("system", "user", "assistant")
MESSAGE_FIELDS = ("role", "content")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# Special tokens a template may name, besides bos_token and eos_token (transformers passes every named one).
OTHER_SPECIAL_TOKENS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Real templates are a few KB (DeepSeek's are under 4 KB); a larger file is not a template.
_MAX_TEMPLATE_BYTES = 1 << 20


class ChatError(ValueError):
    """Messages a template cannot take, or a template that refused them; the message names the message and field."""


def _raise_exception(message: str) -> NoReturn:
    # Templates call raise_exception("Conversation roles must alternate ...") to refuse a chat.
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; a prompt wants the JSON text as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile(source: str) -> jinja2.Template:
    """The template compiled in a fresh sandbox (templates come from the Hub: untrusted code)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def check_messages(messages: object) -> list[dict[str, str]]:
    """The messages of a chat as plain {"role", "content"} dicts; ChatError naming the first bad message and field.

    messages: a non-empty list or tuple of mappings, each with exactly "role" (one of `ROLES`) and
              "content" (a string); nothing is coerced.
    """
    if not isinstance(messages, (list, tuple)):
        raise ChatError(f"a chat must be a list of messages ({{'role': ..., 'content': ...}} dicts), got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ChatError("the chat has no messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"message {i}: must be a dict with 'role' and 'content', got {type(message).__name__}")
        unknown = sorted(repr(k) for k in message if k not in MESSAGE_FIELDS)
        if unknown:
            # Refused rather than dropped: a template would otherwise silently ignore what the caller sent.
            raise ChatError(f"message {i}: unknown fields {', '.join(unknown)}; a message has 'role' and 'content'")
        for name in MESSAGE_FIELDS:
            if name not in message:
                raise ChatError(f"message {i}: no {name!r}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ChatError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatError(f"message {i}: content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A model's chat template: its Jinja source and the special tokens it may name.

    source:         the Jinja text (compiled on construction: ChatError for a syntax error)
    bos_token:      the tokenizer's beginning-of-sequence token as text (`bos_token` in the template), or None
    eos_token:      its end-of-sequence token as text, or None
    special_tokens: other named special tokens, (name, text) pairs such as ("pad_token", "<pad>")

    A token that is None is left undefined in the template, which renders it as "" (as transformers does).
    """

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ChatError(f"a chat template must be non-empty text, got {self.source!r:.60}")
        try:
            compiled = _compile(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatError(f"chat template: line {e.lineno}: {e.message}") from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat: `messages` checked (`check_messages`), then rendered.

        add_generation_prompt: end with the template's opening of an assistant turn, so that the model
            writes the reply (False renders the chat as it is, e.g. to continue a final assistant message).
        ChatError for bad messages or when the template refuses them (its `raise_exception`).
        """
        if not isinstance(add_generation_prompt, bool):
            raise ChatError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        checked = check_messages(messages)
        tokens = {name: text for name, text in (*self.special_tokens, ("bos_token", self.bos_token),
                                                ("eos_token", self.eos_token)) if text is not None}
        try:
            return self._compiled.render(**tokens, messages=checked, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:  # raise_exception, an undefined name used, a sandbox refusal
            raise ChatError(f"chat template: {e}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError) as e:  # the template's own Python errors
            raise ChatError(f"chat template: {type(e).__name__}: {e}") from None


def _token_text(config: Mapping[str, Any], name: str, label: str) -> str | None:
    """A named special token of tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    value = config.get(name)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise CheckpointError(f"{label}: field {name!r} must be a string or a token dict with 'content', got {value!r:.80}")


def _template_source(config: Mapping[str, Any], label: str) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or the "default" of a list of named templates."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise CheckpointError(f"{label}: chat_template[{i}] must be a {{'name', 'template'}} dict of strings, "
                                      f"got {entry!r:.80}")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise CheckpointError(f"{label}: chat_template lists templates {sorted(named)} but none named 'default'")
        return named["default"]
    raise CheckpointError(f"{label}: field 'chat_template' must be a string or a list of {{'name', 'template'}} "
                          f"dicts, got {type(value).__name__}")


def read_chat_template(folder: CheckpointFolder) -> ChatTemplate | None:
    """The folder's chat template (chat_template.jinja, else tokenizer_config.json's), or None without one.

    Its special tokens come from tokenizer_config.json when there is one. CheckpointError names the
    file of a malformed field or a template that does not compile.
    """
    config: Mapping[str, Any] = {}
    config_label = folder.label(TOKENIZER_CONFIG)
    if folder.has(TOKENIZER_CONFIG):
        config = folder.read_json(TOKENIZER_CONFIG)
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_label}: expected a JSON object, got {type(config).__name__}")
    source: str | None
    if folder.has(TEMPLATE_FILE):
        source, label = folder.read_text(TEMPLATE_FILE, _MAX_TEMPLATE_BYTES), folder.label(TEMPLATE_FILE)
    else:
        source, label = _template_source(config, config_label), config_label
    if source is None:
        return None
    special = tuple((name, text) for name in OTHER_SPECIAL_TOKENS
                    if (text := _token_text(config, name, config_label)) is not None)
    try:
        return ChatTemplate(source, bos_token=_token_text(config, "bos_token", config_label),
                            eos_token=_token_text(config, "eos_token", config_label), special_tokens=special)
    except ChatError as e:
        raise CheckpointError(f"{label}: {e}") from None

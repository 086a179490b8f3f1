"""Chat templates: a conversation rendered as the checkpoint's tokenizer expects it.

The template is the Jinja text of ``tokenizer_config.json``'s ``chat_template`` (or of
``chat_template.jinja`` beside it, where newer checkpoints keep it), rendered the way
transformers' ``apply_chat_template`` renders it: a sandboxed ``jinja2`` environment
with ``trim_blocks`` and ``lstrip_blocks``, the loop controls extension, a ``tojson``
filter that does not escape HTML, ``raise_exception`` and ``strftime_now``; the
variables are ``messages``, ``add_generation_prompt`` and the special tokens of
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...).  ``jinja2`` is imported
only here, lazily (it comes with the ``models`` extra).
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Sequence

from ._checkpoint import read_json, require_package

__all__ = ["chat_template", "special_tokens", "render_chat", "end_token_ids"]

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def chat_template(folder: str) -> str:
    """The checkpoint's chat template (the ``default`` one of a list of named ones)."""
    template = read_json(folder, TOKENIZER_CONFIG).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and os.path.isfile(os.path.join(folder, TEMPLATE_FILE)):
        with open(os.path.join(folder, TEMPLATE_FILE), encoding="utf-8") as f:
            template = f.read()
    if not isinstance(template, str) or not template:
        raise ValueError(f"{folder!r} has no chat template (no 'chat_template' in "
                         f"{TOKENIZER_CONFIG}, no {TEMPLATE_FILE})")
    return template


def special_tokens(folder: str) -> dict[str, str]:
    """The special tokens' texts named in ``tokenizer_config.json`` (a string, or an
    added token's ``content``)."""
    cfg = read_json(folder, TOKENIZER_CONFIG)
    out = {}
    for name in SPECIAL:
        value = cfg.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def render_chat(template: str, messages: Sequence[dict[str, Any]], *,
                add_generation_prompt: bool = True, **variables: Any) -> str:
    """The text of ``messages`` (dicts with ``role`` and ``content``) by ``template``."""
    jinja2 = require_package("jinja2", "the chat template")
    require_package("jinja2.sandbox", "the chat template")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        text: str = env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from None
    return text


def end_token_ids(folder: str, model_eos: int | Sequence[int] | None,
                  tokenizer: Any) -> list[int]:
    """The ids that end generation (a reply of ``chat``, the text of ``generate``): each
    ``eos_token_id`` of ``generation_config.json`` (one or a list), the model's (from
    ``config.json``: one or a list), and ``tokenizer_config.json``'s ``eos_token`` (when
    there is a ``tokenizer``, with ``token_to_id``)."""
    ids: list[int] = []
    gen = read_json(folder, "generation_config.json").get("eos_token_id")
    for value in (gen, model_eos):
        for t in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(t, int) and not isinstance(t, bool) and t not in ids:
                ids.append(t)
    eos_text = special_tokens(folder).get("eos_token")
    if eos_text is not None and tokenizer is not None:
        tid = tokenizer.token_to_id(eos_text)
        if tid is not None and tid not in ids:
            ids.append(int(tid))
    return ids

"""Chat prompts at the API edge.

A chat request's prompt comes from the checkpoint's Jinja template when it has one, else
from DeepSeek-V4's own format (cluster/chat/dsv4_encode.py) for a V4 tokenizer, else from the
plain template below.

The plain chat template (used when a checkpoint ships none) is one header line per
message, then the assistant header the model continues from:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
"""
from __future__ import annotations

import functools
import json

from kvmesh.cluster.chat import dsv4_encode
from kvmesh.cluster.errors import bad_request


def plain_chat_prompt(messages: list[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def _raise_exception(message):
    raise ValueError(message)


@functools.lru_cache(maxsize=8)
def compiled_template(template: str):
    """The Jinja template compiled once per text, in its own sandboxed environment with
    `raise_exception` and a `tojson` filter (transformers caches its compiled templates alike, an
    lru_cache keyed by the text). A checkpoint has one template, so a few entries suffice; one
    that fails to compile raises on every call (exceptions are not cached)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def render_chat(template: str | None, messages: list[tuple[str, str]], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **template_kwargs) -> str:
    """The checkpoint's Jinja chat template rendered as transformers' `apply_chat_template`
    renders it (the tokenizer's special tokens, then `chat_template_kwargs` such as V4's
    `thinking` switch, over them), or the plain one."""
    if not template:
        return plain_chat_prompt(messages, add_generation_prompt)
    variables = {"bos_token": bos_token, "eos_token": eos_token, **template_kwargs}
    return compiled_template(template).render(
        messages=[{"role": r, "content": c} for r, c in messages],
        add_generation_prompt=add_generation_prompt, **variables)


def chat_prompt_ids(tokenizer, body, special_in_content: bool = False) -> list[int]:
    """A ChatCompletionRequest's prompt ids in the tokenizer's chat format; every refusal is a 400.
    In V4's format the text of the messages is tokenized as text (a special token's string in it
    stays text) unless `special_in_content` (ingress.allow_special_tokens_in_content)."""
    if tokenizer.chat_format == "dsv4":
        try:
            messages = [m.as_dict() for m in body.messages]
            pieces = dsv4_encode.encode_segments(messages, body.thinking_mode, body.effort, body.offered_tools)
        except ValueError as e:      # a malformed message (InvalidRequestError names its field)
            field = getattr(e, "field", None)
            raise bad_request(str(e) if field else f"messages: {e}", field or "messages") from None
        if not body.add_generation_prompt:
            end = pieces[-1][0].removesuffix(dsv4_encode.THINK).removesuffix(dsv4_encode.END_THINK) \
                .removesuffix(dsv4_encode.ASSISTANT)
            pieces[-1] = (end, False)
        return tokenizer.encode_segments(pieces, special_in_content)
    if body.tools and body.tool_choice != "none":
        raise bad_request("tools need a checkpoint in DeepSeek-V4's chat format (its tokenizer, no template)",
                          "tools")
    kwargs = {**tokenizer.special_tokens, **(body.chat_template_kwargs or {})}
    try:
        text = render_chat(tokenizer.chat_template, [(m.role, m.text) for m in body.messages],
                           body.add_generation_prompt, **kwargs)
    except Exception as e:  # a template's raise_exception, or a broken template
        raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
    return (tokenizer.encode_rendered if tokenizer.chat_template else tokenizer.encode)(text)

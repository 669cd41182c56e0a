"""Chat templates: messages -> prompt text -> token ids, rendered the way transformers does.

Templates come from model repos and GGUF files, so they are untrusted code: they run in jinja2's
immutable sandbox, with the same environment and helpers as transformers' ``apply_chat_template``
so that a template renders here exactly as it does there, under the step, CPU time and size limits of
:mod:`runtime.template_sandbox` so that every render ends soon and small.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import SecurityError

from localllm.errors import LocalLLMError
from localllm.runtime.template_sandbox import BoundedEnvironment, RenderLimits, TemplateLimitError, approx_size

if TYPE_CHECKING:
    from localllm.runtime.tokenizer import Tokenizer

#: The fallback for a model that ships no chat template: ChatML
#: (``<|im_start|>role\ncontent<|im_end|>\n`` per message, then ``<|im_start|>assistant\n``).
#: It is what most small instruct models of the Qwen/SmolLM lineage were trained on; for a model
#: that was not, it is at least a plain, readable transcript.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


#: Gemma's turn format, for a Gemma GGUF that ships no template (the Gemma 3 270M file does not):
#: ``<start_of_turn>user\n...<end_of_turn>\n`` and ``model`` for the assistant. Gemma has no system
#: role: a system prompt opens the first user turn, followed by a blank line. Contents are trimmed.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + (message['content'] | trim) + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + ns.system + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def builtin_template(has_token: Any) -> str | None:
    """A template for a vocabulary whose file ships none, recognised by its turn tokens
    (``has_token(text) -> bool``): Gemma's; None for any other (then :data:`DEFAULT_TEMPLATE` applies)."""
    if has_token("<start_of_turn>") and has_token("<end_of_turn>"):
        return GEMMA_TEMPLATE
    return None


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (used by transformers to mark assistant text)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class TemplateRejected(jinja2.exceptions.TemplateError):
    """What a template's ``raise_exception(message)`` raises: it refuses the conversation it was given."""


def _raise_exception(message: str) -> None:
    raise TemplateRejected(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


#: The fix for a template that fails on its own (loops too long, makes too much, breaks the sandbox).
_TEMPLATE_AT_FAULT = ("the template in the model's files is at fault, not the conversation: fix it there, or send "
                      "plain text without a template (localllm run --raw; the server's /v1/completions, or "
                      "/api/generate with \"raw\": true)")


#: The fix for a template that fails on what it was given: a field it reads, or its own fault.
_FIELDS_OR_TEMPLATE = ("check that every message has the fields the template reads; if they do, the template in "
                       "the model's files is at fault")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> tuple[BoundedEnvironment, jinja2.Template]:
    """A template compiled once (compiling takes far longer than rendering); its renders share nothing."""
    env = BoundedEnvironment(
        extra_filters={"tojson": _tojson},
        extra_globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now},
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    try:
        return env, env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise LocalLLMError(
            f"the model's chat template is not valid jinja (line {exc.lineno}: {exc.message})",
            "pass a working template, or use the plain prompt mode",
        ) from exc


def _brief(exc: BaseException, limit: int = 200) -> str:
    """An exception's text, cut to ``limit`` characters (a message may quote a value of any size)."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def reasoning_effort(think: bool | None, effort: str | None) -> str | None:
    """Harmony's ``reasoning_effort`` (low, medium, high) for a request's thinking: its effort where it
    names one, "low" for thinking off or minimal (gpt-oss always thinks: low is the least), None
    (the template's default, medium) for neither."""
    if effort in ("low", "medium", "high"):
        return effort
    return "low" if think is False or effort in ("none", "minimal") else None


def thinking_variables(harmony: bool, think: bool | None, effort: str | None = None) -> dict[str, Any]:
    """The chat template's variables for a request's thinking: harmony's (gpt-oss) ``reasoning_effort``
    (:func:`reasoning_effort`), else ``enable_thinking`` (Qwen3's and others'); none for the defaults."""
    if harmony:
        level = reasoning_effort(think, effort)
        return {} if level is None else {"reasoning_effort": level}
    return {} if think is None else {"enable_thinking": think}


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` (``{"role": ..., "content": ...}`` dicts) with a chat template.

    ``extra`` goes to the template as further variables (e.g. ``enable_thinking``). The render is
    bounded (:class:`runtime.template_sandbox.RenderLimits`, its sizes grown with the conversation's);
    a template that fails, or goes past a limit, is a :class:`LocalLLMError` that says which.
    """
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise LocalLLMError(
                f"a chat message must be a mapping with a 'role', got {message!r}",
                'write messages as {"role": "user", "content": "..."}',
            )
    variables = {
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token or "",
        "eos_token": eos_token or "",
        "tools": tools,
        **extra,
    }
    env, compiled = _compile(template)
    try:
        return env.render(compiled, variables, RenderLimits().for_input(approx_size(variables, 1 << 62)))
    except TemplateLimitError as exc:
        raise LocalLLMError(f"the model's chat template {exc}", _TEMPLATE_AT_FAULT) from exc
    except SecurityError as exc:
        raise LocalLLMError(f"the model's chat template tried something the sandbox forbids: {_brief(exc)}",
                            _TEMPLATE_AT_FAULT) from exc
    except TemplateRejected as exc:
        raise LocalLLMError(
            f"the model's chat template rejected the conversation: {_brief(exc)}",
            "check the roles and their order (some templates allow no system message, or need user/assistant "
            "to alternate)",
        ) from exc
    except jinja2.UndefinedError as exc:
        raise LocalLLMError(f"the model's chat template failed on this conversation: {_brief(exc)}",
                            _FIELDS_OR_TEMPLATE) from exc
    except jinja2.TemplateError as exc:
        raise LocalLLMError(f"the model's chat template failed: {_brief(exc)}", _TEMPLATE_AT_FAULT) from exc
    except RecursionError as exc:
        raise LocalLLMError("the model's chat template recursed too deeply (a macro or loop that calls itself "
                            "without end)", _TEMPLATE_AT_FAULT) from exc
    except MemoryError as exc:
        raise LocalLLMError("the model's chat template ran out of memory", _TEMPLATE_AT_FAULT) from exc
    except ArithmeticError as exc:  # OverflowError, ZeroDivisionError
        raise LocalLLMError(f"the model's chat template failed: {type(exc).__name__}: {_brief(exc)}",
                            _TEMPLATE_AT_FAULT) from exc
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise LocalLLMError(f"the model's chat template failed on this conversation: {_brief(exc)}",
                            _FIELDS_OR_TEMPLATE) from exc


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template: str | None = None,
    **extra: Any,
) -> list[int]:
    """Token ids of a conversation rendered with ``template`` if given, else the model's template,
    else :data:`DEFAULT_TEMPLATE`.

    Many templates write the BOS string themselves; then the tokenizer must not add another one.
    BOS is added only when the model wants one and the rendered text does not already start with it
    (llama.cpp does the same).
    """
    text = render_chat(
        template or tokenizer.chat_template or DEFAULT_TEMPLATE,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        **extra,
    )
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special=not (bos and text.startswith(bos)))

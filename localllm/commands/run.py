"""``localllm run MODEL [PROMPT]``: stream a reply, or chat when no prompt is given."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import click

from localllm.commands.common import (calibration_option, kv_cache_option, note, placement_options,
                                      quant_head_option, speculate_option, threads_option)
from localllm.commands.compile_step import build_after
from localllm.errors import LocalLLMError
from localllm.loaders.calibrate import DEFAULT_CALIBRATION, PULL_CALIBRATION
from localllm.loaders.spec import LoadSpec
from localllm.paths import DEFAULT_MODEL
from localllm.quant.formats import ALL_SCHEMES
from localllm.quant.kernels import BY_NAME as KERNELS_BY_NAME
from localllm.report import describe_model, placement_lines, print_stats
from localllm.runtime.batch import MAX_TOP_LOGPROBS, TokenLogprob
from localllm.runtime.constrain import Grammar, any_json_object, json_schema
from localllm.runtime.sampling import SamplingParams

#: The sampling defaults are SamplingParams' own: one source for the CLI, the engine and the server.
DEFAULTS = SamplingParams()
#: The smallest context anything can run in: one prompt token and one generated token (plus what the
#: model adds to a prompt: a start-of-text token, a chat template).
MIN_CTX = 2
#: Said once when input text held bytes that are not UTF-8.
NOT_UTF8 = "warning: the input is not valid UTF-8; undecodable bytes were replaced with U+FFFD"


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()  # each token as soon as it is decoded


def _stream(pieces: Iterator[str]) -> str:
    out = []
    for piece in pieces:
        _write(piece)
        out.append(piece)
    return "".join(out)


def answer_only(pieces: Iterator[str], show_thinking: bool, harmony: bool = False) -> Iterator[str]:
    """The reply's answer; its thinking block (``<think>…</think>``, or with ``harmony`` gpt-oss's
    analysis message, its final message's header left out) goes to stderr between Ollama's
    "Thinking..." and "...done thinking." lines, or nowhere with ``show_thinking=False``. stdout
    keeps the answer alone, for pipes."""
    from localllm.runtime.textstream import ThinkingSplitter

    splitter = ThinkingSplitter(harmony=harmony)
    thinking = False

    def route(parts: list[tuple[str, str]]) -> Iterator[str]:
        nonlocal thinking
        for kind, text in parts:
            if kind == "answer":
                if thinking and show_thinking:
                    click.echo("\n...done thinking.\n", err=True)
                thinking = False
                yield text
            elif show_thinking:
                if not thinking:
                    click.echo("Thinking...", err=True)
                thinking = True
                click.echo(text, err=True, nl=False)

    for piece in pieces:
        yield from route(splitter.feed(piece))
    yield from route(splitter.flush())
    if thinking and show_thinking:
        click.echo("\n...done thinking.", err=True)


def parse_format(value: str | None) -> Grammar | None:
    """``--format``: "json" (any JSON object), a JSON Schema file, or a schema written inline."""
    if value is None:
        return None
    if value == "json":
        return any_json_object()
    fix = "give --format json, a JSON Schema file, or a schema inline ('{\"type\": \"object\", ...}')"
    if value.lstrip().startswith("{"):
        text, source = value, "the --format schema"
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise LocalLLMError(f"--format {value!r} is neither json nor a schema file", fix)
        text, source = path.read_text(encoding="utf-8", errors="replace"), str(path)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise LocalLLMError(f"{source} is not JSON ({e.msg} at line {e.lineno} column {e.colno})", fix) from None
    return json_schema(schema, where="--format")


# --------------------------------------------------------------------------- input text
def decode_bytes(data: bytes) -> tuple[str, bool]:
    """UTF-8 bytes as text, undecodable bytes replaced by U+FFFD; and whether any were."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def clean_arg(text: str) -> tuple[str, bool]:
    """A command-line argument as valid text: Python hands bytes that are not UTF-8 over as lone
    surrogates (surrogateescape); they become U+FFFD. Also says whether any were replaced."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), True


def _read_prompt(prompt: str | None) -> tuple[str | None, bool]:
    """The prompt argument, joined with piped stdin when there is some (``cat f | localllm run m "sum up:"``),
    and whether undecodable bytes were replaced. Stdin is read as bytes: text mode would stop at the
    first byte that is not UTF-8 with a UnicodeDecodeError."""
    if sys.stdin is None or sys.stdin.isatty():
        return prompt, False
    piped, replaced = decode_bytes(sys.stdin.buffer.read())
    if not piped.strip():
        return prompt, False
    return (f"{prompt}\n\n{piped}" if prompt else piped), replaced


def prompt_overhead(tokenizer, raw: bool, system: str | None) -> int:  # type: ignore[no-untyped-def]
    """Tokens a prompt takes besides its text: in --raw mode the start-of-text token (when the model
    uses one); in a chat what the template puts around an empty message (and the system prompt)."""
    if raw:
        return len(tokenizer.encode(""))
    from localllm.runtime.chat import encode_chat

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": ""}]
    return len(encode_chat(tokenizer, messages))


def check_ctx(ctx: int, max_seq_len: int, overhead: int, raw: bool) -> None:
    """Refuse a context too small for anything to run: one prompt token and one generated token, plus
    the prompt's ``overhead`` (:func:`prompt_overhead`). Warn of one beyond what the model was trained on."""
    need = overhead + MIN_CTX
    if ctx < need and raw:
        start = "the start-of-text token, " if overhead else ""
        raise LocalLLMError(f"--ctx {ctx} is too small: the context must hold {start}one prompt token and one "
                            "generated token", f"give --ctx {need} or more, or leave it out")
    if ctx < need:
        raise LocalLLMError(
            f"--ctx {ctx} is too small for a chat with this model: its chat template takes {overhead} tokens, "
            "plus one prompt token and one generated token",
            f"give --ctx {need} or more (more for a longer prompt and reply), or --raw for plain text")
    if ctx > max_seq_len:
        click.echo(f"warning: --ctx {ctx} is beyond the {max_seq_len} tokens the model was trained on; "
                   f"replies past {max_seq_len} tokens may lose coherence", err=True)


@click.command()
@click.argument("model", default=DEFAULT_MODEL, required=False)
@click.argument("prompt", required=False)
@click.option("--system", help="System prompt.")
@click.option("--temperature", type=float, default=DEFAULTS.temperature, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=DEFAULTS.top_k, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=DEFAULTS.top_p, show_default=True)
@click.option("--min-p", type=float, default=DEFAULTS.min_p, show_default=True)
@click.option("--repeat-penalty", type=float, default=DEFAULTS.repeat_penalty, show_default=True, help="1.0 = off.")
@click.option("--seed", type=int, help="Seed for reproducible sampling.")
@click.option("--max-tokens", "-n", type=int, help="Stop after this many generated tokens.")
@click.option("--ctx", type=int, help="Context length (prompt + reply). Default: the model's, at most 4096.")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@click.option("--dtype", default="auto", show_default=True,
              help="Activations (and the KV cache): auto (bf16 on CUDA; fp32 on the CPU, or bf16 for a quantized "
                   "model that keeps a float embedding table or head), fp32, fp16, bf16.")
@threads_option
@click.option("--quant", "-q", type=click.Choice(ALL_SCHEMES),
              help="Weight scheme; quantized at load when the model is stored in another. "
                   "Default: the model's own (int4 for Q4 GGUF files).")
@click.option("--group-size", type=int, help="Quantization group size (int4: 32/64/128/256; int8: per channel).")
@quant_head_option("Default: as stored (a GGUF's as in the file); a float head quantized with the rest becomes int8.")
@calibration_option(None, "Default: auto where a Hub repo id is pulled first (stored once), none where a folder "
                         "is quantized at every load (pull it to calibrate it once).")
@click.option("--kernel", type=click.Choice(list(KERNELS_BY_NAME)),
              help="Force a matmul kernel (default: the fastest that works here).")
@click.option("--compile/--no-compile", "compile_", default=None,
              help="Default: on the CPU, use the model's compiled decode step when one is built (set-up builds the "
                   "embedded model's; otherwise a first run builds it in the background for the next, see "
                   "`localllm compile`), else run eagerly. --compile builds it now if needed (about a minute once, "
                   "on the CPU); --no-compile always runs eagerly.")
@kv_cache_option
@placement_options
@speculate_option
@click.option("--format", "format_", metavar="json|SCHEMA",
              help="Hold the reply to JSON: 'json' (any object), or a JSON Schema (a file, or written inline) "
                   "it must validate against. Enforced token by token, so the reply always parses.")
@click.option("--logprobs", type=click.IntRange(0, MAX_TOP_LOGPROBS), metavar="N",
              help="After the answer, on stderr: each generated token's probability under the model (before "
                   "temperature, filters and --format), and the N most likely tokens in its place.")
@click.option("--raw", is_flag=True, help="Continue the prompt as plain text: no chat template.")
@click.option("--think/--no-think", "think", default=None,
              help="Thinking models (Qwen3): let the model think before answering, or not (the template's "
                   "enable_thinking). Default: the template's own.")
@click.option("--hide-thinking", is_flag=True,
              help="Do not show the reply's thinking block (shown on stderr by default; stdout holds the answer).")
@click.option("--verbose", "-v", is_flag=True, help="Timing statistics to stderr, as Ollama prints them.")
def run(
    model: str,
    prompt: str | None,
    system: str | None,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    seed: int | None,
    max_tokens: int | None,
    ctx: int | None,
    stop: tuple[str, ...],
    device: str,
    dtype: str,
    threads: int | None,
    quant: str | None,
    group_size: int | None,
    quant_head: str | None,
    calibration: str | None,
    kernel: str | None,
    compile_: bool | None,
    kv_cache: str,
    cpu_moe: bool,
    n_cpu_moe: int | None,
    gpu_layers: int | None,
    speculate: str,
    format_: str | None,
    logprobs: int | None,
    raw: bool,
    think: bool | None,
    hide_thinking: bool,
    verbose: bool,
) -> None:
    """Run MODEL (a stored NAME[:SCHEME], a model folder, a .gguf file, 'smollm2', or a Hub ORG/NAME, pulled
    first if not stored) on PROMPT.

    With no PROMPT and a terminal on stdin, starts an interactive chat (Ctrl-D to quit).
    """
    from localllm.loaders.load import load_model
    from localllm.loaders.memory_plan import check_memory
    from localllm.loaders.pull import pull_if_missing
    from localllm.loaders.store import check_local_path
    from localllm.runtime.engine import Engine
    from localllm.threads import set_threads

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed)
    if max_tokens is not None and max_tokens < 1:
        raise LocalLLMError(f"--max-tokens {max_tokens} is not positive", "give 1 or more, or leave it out")
    if ctx is not None and ctx < 1:  # before loading anything; the exact minimum is known once the model is
        raise LocalLLMError(f"--ctx {ctx} is not positive", f"give the context length in tokens: {MIN_CTX} or more "
                            "(one prompt token, one generated token), plus what the model adds to a prompt (a "
                            "start-of-text token, a chat template); or leave it out")
    grammar = parse_format(format_)  # a bad schema is refused before anything loads
    check_local_path(model)
    set_threads(threads)
    args = [clean_arg(s) for s in (prompt or "", system or "", *stop)]
    prompt = args[0][0] if prompt is not None else None
    system = args[1][0] if system is not None else None
    stop = tuple(s for s, _ in args[2:])
    text, piped_replaced = _read_prompt(prompt)
    if piped_replaced or any(replaced for _, replaced in args):
        click.echo(NOT_UTF8, err=True)

    model = pull_if_missing(model, quant, group_size, notify=note,  # a Hub repo id: pulled
                            calibration=calibration or PULL_CALIBRATION)
    spec = LoadSpec(model, device, dtype, quant, group_size, quant_head, kernel, kv_cache,
                    calibration or DEFAULT_CALIBRATION, cpu_moe, n_cpu_moe, gpu_layers)
    # Before anything is loaded: does it fit? If not, the plan's numbers and the cheapest change that does.
    plan = check_memory(spec, ctx, kv_cache_flag=True)
    # on a GPU: experts and blocks placed as the plan for this context placed them
    where = plan.placement
    if where is not None:
        auto_experts = not (spec.cpu_moe or spec.n_cpu_moe is not None)
        spec = replace(spec, n_cpu_moe=where.n_cpu_moe if auto_experts else spec.n_cpu_moe,
                       gpu_layers=(where.n_gpu_layers if where.n_gpu_layers is not None else len(where.expert_bytes))
                       if spec.gpu_layers is None else spec.gpu_layers)
    lm = load_model(spec)
    if where is not None:
        lm.placement = where  # chosen for this context (automatically, or by the flags): said so by --verbose
    if lm.calibration is not None:
        note(lm.calibration.summary())
    ctx = ctx if ctx is not None else min(lm.config.max_seq_len, 4096)
    check_ctx(ctx, lm.config.max_seq_len, prompt_overhead(lm.tokenizer, raw, system), raw)
    if compile_:
        click.echo("compiling the decode step if it is not built yet (about a minute once)...", err=True)
    engine = Engine(lm.model, lm.tokenizer, ctx, compile="auto" if compile_ is None else compile_,
                    kv_dtype=spec.kv_dtype, speculate=speculate == "on")
    load_s = lm.load_s + engine.compile_s  # what came before the prompt, as Ollama counts it
    if compile_ and verbose:
        click.echo(f"compiled in {engine.compile_s:.1f} s ({engine.step_kind})", err=True)
    if verbose:
        describe_model(lm, ctx, spec.kv_dtype)
        # on a GPU: where the experts and blocks live, and why; a split model's steps run eagerly
        for line in placement_lines(lm, engine.batch.runner.eager_reason):
            click.echo(f"placement: {line}", err=True)
        click.echo(f"decode step: {engine.step_kind}", err=True)
        if engine.batch.compile_note:  # which steps run eagerly although compiled ones were asked for, and why
            click.echo(f"  {engine.batch.compile_note}", err=True)
    # Once this run is done (its tokens are not slowed by it): build the step the next run will use.
    needs_build = engine.needs_build

    if text is None:
        _chat(engine, params, system, max_tokens, stop, verbose, load_s, think, not hide_thinking, grammar, logprobs)
        build_after(spec, needs_build, engine.build_batch)
        return
    if raw:
        pieces = engine.complete(text, params, max_tokens, stop, grammar, logprobs)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        pieces = answer_only(engine.chat(messages, params, max_tokens, stop, think, grammar, logprobs),
                             not hide_thinking, engine.harmony)
    _stream(pieces)
    _write("\n")
    if logprobs is not None:
        print_logprobs(engine.logprobs, engine.constraints.token_bytes)
    _after(engine, verbose, load_s)
    build_after(spec, needs_build, engine.build_batch)


def print_logprobs(entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> None:
    """Each generated token with its probability, then its alternatives, one line each, on stderr."""
    def show(token_id: int) -> str:
        return repr(token_bytes(token_id).decode("utf-8", errors="replace"))

    click.echo("token probabilities (the model's own, before sampling settings; then the most likely there):",
               err=True)
    for e in entries:
        alts = "  ".join(f"{show(i)} {math.exp(v):.1%}" for i, v in e.top)
        click.echo(f"  {show(e.token):<18} {math.exp(e.logprob):>6.1%}" + (f"   | {alts}" if alts else ""), err=True)


def _ask(prompt: str = ">>> ") -> str:
    """One line from the user. The prompt goes to stderr unless stdout is the terminal too, so a
    redirected stdout holds only the model's replies. Bytes that are not UTF-8 become U+FFFD."""
    if sys.stdout.isatty():
        try:
            line, replaced = clean_arg(input(prompt))  # readline editing and history
        except UnicodeDecodeError:  # the terminal's text decoder is strict: the line is lost, not the chat
            line, replaced = "", True
    else:
        sys.stderr.write(prompt)
        sys.stderr.flush()
        data = sys.stdin.buffer.readline()
        if not data:
            raise EOFError
        line, replaced = decode_bytes(data.rstrip(b"\n"))
    if replaced:
        click.echo(NOT_UTF8, err=True)
    return line


def _after(engine, verbose: bool, load_s: float | None) -> None:  # type: ignore[no-untyped-def]
    if engine.stats.stop_reason == "context":
        click.echo(f"\nstopped: the context of {engine.ctx} tokens is full; use --ctx to allow more", err=True)
    elif engine.stats.stop_reason == "constraint":
        click.echo(f"\nstopped: the --format grammar allowed no further token ({engine.stats.constraint_error})",
                   err=True)
    if verbose:
        print_stats(engine.stats, load_s)


def _chat(engine, params, system, max_tokens, stop: Sequence[str], verbose,  # type: ignore[no-untyped-def]
          load_s, think: bool | None = None, show_thinking: bool = True, grammar: Grammar | None = None,
          logprobs: int | None = None) -> None:
    """Multi-turn chat on a terminal: history kept, /clear forgets it, Ctrl-D or /bye ends it."""
    click.echo(">>> Chat (Ctrl-D or /bye to quit, /clear to forget the conversation, Ctrl-C stops a reply)", err=True)
    messages = [{"role": "system", "content": system}] if system else []
    history_start = len(messages)
    while True:
        try:
            line = _ask()
        except (EOFError, KeyboardInterrupt):
            click.echo("", err=True)
            return
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/bye", "/exit", "/quit"):
            return
        if cmd == "/clear":
            del messages[history_start:]
            click.echo("conversation cleared", err=True)
            continue
        messages.append({"role": "user", "content": line})
        reply: list[str] = []
        try:
            for piece in answer_only(engine.chat(messages, params, max_tokens, stop, think, grammar, logprobs),
                                     show_thinking, engine.harmony):
                _write(piece)
                reply.append(piece)
        except KeyboardInterrupt:
            click.echo("\n(stopped)", err=True)
        except LocalLLMError as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            messages.pop()
            click.echo(f"\nError: {e.one_line()} (or /clear)", err=True)
            continue
        _write("\n\n")
        if logprobs is not None:
            print_logprobs(engine.logprobs, engine.constraints.token_bytes)
        messages.append({"role": "assistant", "content": "".join(reply)})
        _after(engine, verbose, load_s if len(messages) <= history_start + 2 else None)

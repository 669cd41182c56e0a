"""``localllm run MODEL [PROMPT]``: stream a reply, or chat when no prompt is given."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import click

from localllm.errors import LocalLLMError
from localllm.paths import DEFAULT_MODEL
from localllm.report import describe_model, print_stats
from localllm.runtime.sampling import SamplingParams


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()  # each token as soon as it is decoded


def _stream(pieces: Iterator[str]) -> str:
    out = []
    for piece in pieces:
        _write(piece)
        out.append(piece)
    return "".join(out)


def _read_prompt(prompt: str | None) -> str | None:
    """The prompt argument, joined with piped stdin when there is some (``cat f | localllm run m "sum up:"``)."""
    if sys.stdin is None or sys.stdin.isatty():
        return prompt
    piped = sys.stdin.read()
    if not piped.strip():
        return prompt
    return f"{prompt}\n\n{piped}" if prompt else piped


@click.command()
@click.argument("model", default=DEFAULT_MODEL, required=False)
@click.argument("prompt", required=False)
@click.option("--system", "-s", help="System prompt.")
@click.option("--temperature", "-t", type=float, default=0.8, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=40, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=0.9, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repeat-penalty", type=float, default=1.0, show_default=True, help="1.0 = off.")
@click.option("--seed", type=int, help="Seed for reproducible sampling.")
@click.option("--max-tokens", "-n", type=int, help="Stop after this many generated tokens.")
@click.option("--ctx", type=int, help="Context length (prompt + reply). Default: the model's, at most 4096.")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@click.option("--dtype", default="auto", show_default=True,
              help="Activations: auto (bf16 on CUDA and for quantized weights, else fp32), fp32, fp16, bf16.")
@click.option("--quant", "-q", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4", "nf4"]),
              help="Weight scheme; quantized at load when the model is stored in another. "
                   "Default: the model's own (int4 for Q4 GGUF files).")
@click.option("--group-size", type=int, help="Quantization group size (int4: 32/64/128/256; int8: per channel).")
@click.option("--quant-head", type=click.Choice(["int8", "int4", "nf4", "none"]),
              callback=lambda ctx, param, value: False if value == "none" else value,
              help="Scheme of the output head (int8 also serves a tied embedding table); none = 16-bit. "
                   "Default: as stored; on the CPU a GGUF's Q8_0 head as it is; else 16-bit.")
@click.option("--kernel", type=click.Choice(["int4-tinygemm-cpu", "int4-tinygemm-cuda", "int8-weight-only",
                                             "int8-group-cpu", "nf4-bitsandbytes", "reference"]),
              help="Force a matmul kernel (default: the fastest that works here).")
@click.option("--compile", "compile_", is_flag=True,
              help="Compile the decode step (AOTInductor on the CPU, torch.compile on CUDA): faster tokens after a "
                   "one-time compilation, cached on disk.")
@click.option("--raw", is_flag=True, help="Continue the prompt as plain text: no chat template.")
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
    quant: str | None,
    group_size: int | None,
    quant_head: str | None,
    kernel: str | None,
    compile_: bool,
    raw: bool,
    verbose: bool,
) -> None:
    """Run MODEL (a stored NAME[:SCHEME], a model folder, a .gguf file, 'smollm2', or a Hub ORG/NAME, pulled
    first if not stored) on PROMPT.

    With no PROMPT and a terminal on stdin, starts an interactive chat (Ctrl-D to quit).
    """
    from localllm.commands.common import note
    from localllm.loaders.load import load_model
    from localllm.loaders.pull import pull_if_missing
    from localllm.loaders.store import check_local_path
    from localllm.runtime.engine import Engine

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed)
    if max_tokens is not None and max_tokens < 1:
        raise LocalLLMError(f"--max-tokens {max_tokens} is not positive", "give 1 or more, or leave it out")
    check_local_path(model)
    text = _read_prompt(prompt)
    model = pull_if_missing(model, quant, group_size, notify=note)  # a Hub repo id not stored yet is pulled first
    lm = load_model(model, device=device, dtype=dtype, quant=quant, group_size=group_size,
                    quantize_head=quant_head, kernel=kernel)
    ctx = ctx or min(lm.config.max_seq_len, 4096)
    if ctx < 2:
        raise LocalLLMError(f"--ctx {ctx} is too small", "give at least a few hundred tokens")
    if ctx > lm.config.max_seq_len:
        click.echo(f"warning: --ctx {ctx} is beyond the {lm.config.max_seq_len} tokens the model was trained on",
                   err=True)
    if compile_:
        click.echo("compiling the decode step (about half a minute the first time, a second once cached)...", err=True)
    engine = Engine(lm.model, lm.tokenizer, ctx, compile=compile_)
    load_s = lm.load_s + engine.generator.compile_s  # what came before the prompt, as Ollama counts it
    if compile_ and verbose:
        click.echo(f"compiled in {engine.generator.compile_s:.1f} s ({engine.generator.step_kind})", err=True)
    if verbose:
        describe_model(lm, ctx)

    if text is None:
        _chat(engine, params, system, max_tokens, stop, verbose, load_s)
        return
    if raw:
        pieces = engine.complete(text, params, max_tokens, stop)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        pieces = engine.chat(messages, params, max_tokens, stop)
    _stream(pieces)
    _write("\n")
    _after(engine, verbose, load_s)


def _ask(prompt: str = ">>> ") -> str:
    """One line from the user. The prompt goes to stderr unless stdout is the terminal too, so a
    redirected stdout holds only the model's replies."""
    if sys.stdout.isatty():
        return input(prompt)  # readline editing and history
    sys.stderr.write(prompt)
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _after(engine, verbose: bool, load_s: float | None) -> None:  # type: ignore[no-untyped-def]
    if engine.stats.stop_reason == "context":
        click.echo(f"\nstopped: the context of {engine.ctx} tokens is full; use --ctx to allow more", err=True)
    if verbose:
        print_stats(engine.stats, load_s)


def _chat(engine, params, system, max_tokens, stop, verbose, load_s) -> None:  # type: ignore[no-untyped-def]
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
            for piece in engine.chat(messages, params, max_tokens, stop):
                _write(piece)
                reply.append(piece)
        except KeyboardInterrupt:
            click.echo("\n(stopped)", err=True)
        except LocalLLMError as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            messages.pop()
            click.echo(f"\nError: {e.one_line()} (or /clear)", err=True)
            continue
        _write("\n\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        _after(engine, verbose, load_s if len(messages) <= history_start + 2 else None)

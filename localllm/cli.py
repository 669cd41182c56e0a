"""The ``localllm`` command: a click group; each command lives in ``localllm/commands/``.

Generated text goes to stdout; progress, warnings and statistics to stderr. A
:class:`~localllm.errors.LocalLLMError` becomes one line ``Error: ...`` and exit code 1
(set ``LOCALLLM_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import os
import sys
import warnings

import click

from localllm import __version__
from localllm.errors import LocalLLMError


def debug_enabled() -> bool:
    return os.environ.get("LOCALLLM_DEBUG", "") not in ("", "0")


def _one_line_warning(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
    click.echo(f"warning: {message}", err=True)


#: Short flags localllm does not have because llama.cpp or Ollama give them another meaning, and what to use.
DROPPED_SHORT_FLAGS = {
    "-t": "the temperature is --temperature; llama.cpp's -t, the thread count, is --threads",
    "-s": "the system prompt is --system; llama.cpp's -s, the seed, is --seed",
    "-f": "pull's --force is spelled out; for llama.cpp's -f, a prompt file, pipe it: localllm run MODEL < FILE",
}


class OneLineUsageError(click.UsageError):
    """A command-line mistake as one line on stderr (exit code 2, as click's usage errors), naming the
    command's --help instead of printing its usage."""

    def show(self, file=None) -> None:  # type: ignore[no-untyped-def]
        command = self.ctx.command_path if self.ctx is not None else "localllm"
        click.echo(f"Error: {self.format_message()}; see `{command} --help`", err=True)


def _usage_message(e: click.UsageError) -> str:
    message = " ".join(e.format_message().split()).rstrip(".")
    if isinstance(e, click.NoSuchOption) and e.option_name in DROPPED_SHORT_FLAGS:
        message += f" ({DROPPED_SHORT_FLAGS[e.option_name]})"
    return message


class _Group(click.Group):
    def invoke(self, ctx: click.Context):  # type: ignore[no-untyped-def]
        shown = warnings.showwarning
        if not debug_enabled():  # a warning is one line on stderr, not a source location and its code
            warnings.showwarning = _one_line_warning
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            if debug_enabled() or isinstance(e, OneLineUsageError):
                raise
            raise OneLineUsageError(_usage_message(e), e.ctx) from None
        except LocalLLMError as e:
            if debug_enabled():
                raise
            raise click.ClickException(e.one_line()) from None
        except MemoryError:
            if debug_enabled():
                raise
            raise click.ClickException(
                "out of memory; try a smaller scheme (--quant int4) or a shorter context (--ctx)"
            ) from None
        except KeyboardInterrupt:
            click.echo("", err=True)
            ctx.exit(130)
        except BrokenPipeError:
            # stdout was closed by the reader (e.g. `| head`): not an error of ours.
            sys.stderr.close()
            ctx.exit(0)
        finally:
            warnings.showwarning = shown


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="localllm")
def main() -> None:
    """Run quantized LLMs locally, on a consumer GPU or the CPU."""


def _register() -> None:
    from localllm.commands import bench, compile_step, export, run, serve, store

    main.add_command(run.run)
    main.add_command(compile_step.compile_step)
    main.add_command(bench.bench)
    main.add_command(serve.serve)
    main.add_command(export.export)
    for command in (store.pull, store.list_models, store.show, store.rm):
        main.add_command(command)


_register()

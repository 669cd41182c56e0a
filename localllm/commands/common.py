"""What several commands share: options defined once, and how loaders' progress lines are printed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from localllm.quant.formats import QUANT_SCHEMES

def note(message: str) -> None:
    """A line about what is going on (a loader's progress callback): stderr, so stdout keeps only results."""
    click.echo(message, err=True)


threads_option = click.option("--threads", type=int, help="CPU threads torch computes with (default: one per core).")


def quant_head_option(default: str) -> Callable[[Any], Any]:
    """``--quant-head int8|int4|nf4|none``: the output head's scheme; ``none`` arrives as False (16-bit)."""
    return click.option(
        "--quant-head", type=click.Choice([*QUANT_SCHEMES, "none"]),
        callback=lambda ctx, param, value: False if value == "none" else value,
        help="Scheme of the output head (int8 also serves a tied embedding table); none = 16-bit. " + default)

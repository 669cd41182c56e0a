"""What a bench run measures: its settings, their checks, the evaluation text, the log callback."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from localllm.errors import LocalLLMError
from localllm.quant.formats import ALL_SCHEMES

#: Highest precision first: the first of these in a run is the quality reference and the baseline column.
PRECISION_ORDER = ALL_SCHEMES  # quant.formats lists them in this order: fp32, fp16, bf16, int8, int4, nf4
DEFAULT_SCHEMES = {"cpu": ("fp32", "bf16", "int8", "int4", "nf4"), "cuda": ("fp16", "bf16", "int8", "int4", "nf4")}
KV_REPORT_STEPS = (1, 10, 20, 50, 100)
KV_PROMPT_TOKENS = 16  # short, so that 100 uncached steps show the growth with length (and stay quick)
QUALITY_WINDOW = 512
#: The memory target: peak growth at most MEMORY_BOUND_FACTOR x (weights + KV cache) + MEMORY_BOUND_SLACK bytes.
MEMORY_BOUND_FACTOR = 1.15
MEMORY_BOUND_SLACK = 64 * 10**6  # 64 MB, 1000-based like every size the CLI prints
WARMUP_RUNS = 1
#: The evaluation text shipped with localllm (``localllm/data/eval.txt``).
EVAL_TEXT = Path(__file__).resolve().parents[1] / "data" / "eval.txt"

Log = Callable[[str], None]
Figures = dict[str, Any]


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Settings:
    """What to measure; validated by :func:`check_settings` before anything is loaded."""

    schemes: list[str]
    device: torch.device
    prompt_tokens: int = 512
    gen_tokens: int = 128
    ctx: int | None = None  # None: prompt_tokens + gen_tokens
    runs: int = 5
    quality: bool = True
    kv_compare: bool = False
    compile: bool = False  # the compiled decode step (built, if missing, before the first run)
    warmup: int = WARMUP_RUNS
    notes: list[str] = field(default_factory=list)
    #: How the compiled decode steps actually ran ("aot", "eager"), filled by the runs.
    step_kinds: set[str] = field(default_factory=set)
    kv_dtype: str = "16bit"  # the generators' KV cache: "16bit" (the activations' dtype) or "int8"

    @property
    def context(self) -> int:
        return self.ctx if self.ctx is not None else self.prompt_tokens + self.gen_tokens

    @property
    def baseline(self) -> str:
        return baseline_scheme(self.schemes)


def parse_schemes(text: str | None, device: torch.device) -> list[str]:
    """``"fp32,int4"`` -> ["fp32", "int4"] (order kept, duplicates dropped); None -> the device's default."""
    if text is None:
        return list(DEFAULT_SCHEMES["cuda" if device.type == "cuda" else "cpu"])
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise LocalLLMError("--quant is empty", f"give a comma-separated list of {', '.join(PRECISION_ORDER)}")
    for name in names:
        if name not in PRECISION_ORDER:
            raise LocalLLMError(f"unknown scheme '{name}' in --quant",
                                f"use a comma-separated list of {', '.join(PRECISION_ORDER)}")
    return names


def baseline_scheme(schemes: Sequence[str]) -> str:
    """The highest-precision scheme of the run: the quality reference and the ratios' denominator."""
    return min(schemes, key=PRECISION_ORDER.index)


def check_settings(s: Settings) -> None:
    """Refuse settings that cannot give meaningful figures, with the fix, before any loading."""
    if s.prompt_tokens < 1:
        raise LocalLLMError(f"--prompt-tokens {s.prompt_tokens} is not positive", "give 1 or more (default 512)")
    if s.gen_tokens < 2:
        raise LocalLLMError(f"--gen-tokens {s.gen_tokens} is too few to time decoding",
                            "give 2 or more (the first token comes from prefill)")
    if s.runs < 1:
        raise LocalLLMError(f"--runs {s.runs} is not positive", "give 1 or more (default 5)")
    need = s.prompt_tokens + s.gen_tokens
    if s.ctx is not None and s.ctx < need:
        raise LocalLLMError(
            f"--ctx {s.ctx} is shorter than the {s.prompt_tokens} prompt + {s.gen_tokens} generated tokens",
            f"give --ctx {need} or more, or fewer --prompt-tokens/--gen-tokens")


def check_text(ids: Sequence[int], prompt_tokens: int, source: str) -> None:
    if len(ids) < max(prompt_tokens, 2):
        raise LocalLLMError(
            f"{source} is {len(ids)} tokens long, shorter than the {prompt_tokens} the prompt needs",
            "give a longer --text or fewer --prompt-tokens")


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(what to call it, the text): the user's file, or the evaluation text shipped with localllm."""
    if path is None:
        return "the built-in eval text", EVAL_TEXT.read_text(encoding="utf-8")
    try:
        return str(path), Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"cannot read --text {path}: {getattr(e, 'strerror', None) or e}",
                            "give a readable UTF-8 text file") from None

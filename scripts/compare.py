#!/usr/bin/env python
"""localllm next to transformers (and llama.cpp when ``llama_cpp`` is importable), side by side in one run.

    .venv/bin/python scripts/compare.py [--threads 2] [--runs 5] [--gen 64] [--prompt-tokens 128]

Every engine runs the same GGUF (the embedded SmolLM2 by default) on the same prompt, greedy, for
the same number of tokens (end-of-sequence ignored). localllm runs through its batch engine of one
sequence (``runtime.engine.sequence_engine``, what ``run`` uses; prefix cache off, so every round
prefills the whole prompt); the ``-compiled`` rows take the compiled decode step, built first if
missing (``localllm compile``; about a minute once). Prefill rate = prompt tokens / time to the
first token; decode rate = (tokens - 1) / (time from the first token to the last). Figures are
medians over ``--runs`` rounds, run round-robin after a warm-up of each; the ratio column divides by
transformers fp32 decode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from localllm.paths import default_model_gguf

# A fixed English text, cut to the requested number of tokens.
TEXT = (
    "The printing press, invented by Johannes Gutenberg around 1440, changed how knowledge spread across "
    "Europe. Before it, books were copied by hand, slowly and at great cost, so few people owned any. "
    "With movable metal type, a workshop could print hundreds of pages a day, and the price of books fell. "
    "Within fifty years, presses were running in more than two hundred cities, and millions of volumes had "
    "been printed. Literacy rose, scientific results could be shared exactly, and new ideas travelled faster "
    "than any authority could stop them. Historians still argue about how much the press caused the "
    "Reformation and the scientific revolution, but few doubt that it made both spread further and faster. "
) * 8

Timing = tuple[float, float]  # (seconds to first token, seconds from first to last token)


def measure_interleaved(engines: dict[str, Callable[[], Timing]], runs: int, prompt_tokens: int, gen: int,
                        pause_s: float = 0.3) -> dict[str, dict[str, float]]:
    """One warm-up each, then ``runs`` rounds in which every engine runs once, in turn.

    Round-robin rather than engine after engine: a shared machine's speed drifts over minutes, and
    this way the drift falls on every engine alike. The pause lets one engine's worker threads stop
    spinning before the next engine starts.
    """
    for once in engines.values():
        once()
    timings: dict[str, list[Timing]] = {name: [] for name in engines}
    for _ in range(runs):
        for name, once in engines.items():
            time.sleep(pause_s)
            timings[name].append(once())
    return {name: summarize(t, prompt_tokens, gen) for name, t in timings.items()}


def summarize(timings: list[Timing], prompt_tokens: int, gen: int) -> dict[str, float]:
    ttft, decode = zip(*timings)
    return {
        "ttft_ms": statistics.median(ttft) * 1e3,
        "prefill_tps": prompt_tokens / statistics.median(ttft),
        "decode_tps": (gen - 1) / statistics.median(decode),
        "decode_tps_min": (gen - 1) / max(decode),
        "decode_tps_max": (gen - 1) / min(decode),
    }


def localllm_engine(path: Path, quant: str, ids: list[int], gen: int, head: str | None = None,
                    compile: bool = False) -> Callable[[], Timing]:
    from localllm.loaders.load import load_model
    from localllm.runtime.engine import sequence_engine
    from localllm.runtime.sampling import SamplingParams

    lm = load_model(str(path), device="cpu", quant=quant, quantize_head=head)
    # one sequence, as `run`; no prefix cache, so that every round prefills the whole prompt
    engine = sequence_engine(lm.model, len(ids) + gen + 8, compile=compile, prefix_cache=False)
    out = lm.model.output
    head_label = out.scheme.label() if hasattr(out, "scheme") else str(lm.dtype).removeprefix("torch.")
    # say how it really runs (a failed build runs eagerly, saying why)
    step = "aot" if engine.compiled else "eager"
    print(f"localllm {quant}: head {head_label}, kernels {dict(lm.kernels)}"
          + (f"; decode step {step}, built or loaded in {engine.compile_s:.1f} s" if compile else "")
          + (f" ({engine.compile_note})" if compile and engine.compile_note else ""),
          file=sys.stderr)
    greedy = SamplingParams(temperature=0)

    def once() -> Timing:
        handle = engine.submit(ids, greedy, max_tokens=gen)  # no stop ids: end-of-sequence ignored
        n = len(handle.result())
        assert n == gen, (n, handle.stats.stop_reason)
        return handle.stats.prompt_s, handle.stats.decode_s

    return once


def transformers_engine(path: Path, dtype: torch.dtype, ids: list[int], gen: int) -> Callable[[], Timing]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    x = torch.tensor([ids])

    class FirstToken(transformers.generation.streamers.BaseStreamer):
        def __init__(self) -> None:
            self.calls, self.first = 0, 0.0

        def put(self, value) -> None:  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls == 2:  # the first call carries the prompt, the second the first new token
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def once() -> Timing:
        s = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=gen, min_new_tokens=gen, do_sample=False, streamer=s)
        t1 = time.perf_counter()
        assert out.shape[1] == len(ids) + gen
        return s.first - t0, t1 - s.first

    return once


def llama_cpp_engine(path: Path, threads: int, ids: list[int], gen: int) -> Callable[[], Timing]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + gen + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)

    def once() -> Timing:
        llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for _ in llm.generate(ids, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == gen:
                break
        return first - t0, time.perf_counter() - first  # type: ignore[operator]

    return once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=default_model_gguf(), help="a .gguf file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--engines", default="transformers-fp32,llama.cpp,localllm-fp32,localllm-bf16,localllm-int4,"
                    "localllm-int4-compiled,localllm-int4-h8-compiled")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from localllm.loaders.load import load_tokenizer, open_checkpoint

    ids = load_tokenizer(open_checkpoint(str(args.model))).encode(TEXT)[: args.prompt_tokens]
    factories: dict[str, Callable[[], Callable[[], Timing]]] = {
        "localllm-fp32": lambda: localllm_engine(args.model, "fp32", ids, args.gen),
        "localllm-bf16": lambda: localllm_engine(args.model, "bf16", ids, args.gen),
        "localllm-int8": lambda: localllm_engine(args.model, "int8", ids, args.gen),
        "localllm-int4": lambda: localllm_engine(args.model, "int4", ids, args.gen),
        "localllm-int4-compiled": lambda: localllm_engine(args.model, "int4", ids, args.gen, compile=True),
        "localllm-int4-h8": lambda: localllm_engine(args.model, "int4", ids, args.gen, head="int8"),
        "localllm-int4-h8-compiled": lambda: localllm_engine(args.model, "int4", ids, args.gen, head="int8",
                                                             compile=True),
        "transformers-fp32": lambda: transformers_engine(args.model, torch.float32, ids, args.gen),
        "transformers-bf16": lambda: transformers_engine(args.model, torch.bfloat16, ids, args.gen),
        "llama.cpp": lambda: llama_cpp_engine(args.model, args.threads, ids, args.gen),
    }
    engines: dict[str, Callable[[], Timing]] = {}
    for name in args.engines.split(","):
        try:
            engines[name] = factories[name]()
        except ImportError as e:
            print(f"# {name}: skipped ({e})")
    results = measure_interleaved(engines, args.runs, len(ids), args.gen)

    base = results.get("transformers-fp32", {}).get("decode_tps")
    cpp = results.get("llama.cpp", {})
    print(f"# {args.model.name}, {torch.get_num_threads()} threads, prompt {len(ids)} tokens, {args.gen} generated, "
          f"median of {args.runs} runs (decode min-max in brackets)")
    print(f"{'engine':<26} {'TTFT ms':>8} {'prefill tok/s':>14} {'decode tok/s':>20} {'decode vs HF fp32':>18} "
          f"{'vs llama.cpp (prefill, decode)':>31}")
    for name, r in results.items():
        ratio = f"{r['decode_tps'] / base:.2f}x" if base else "-"
        vs_cpp = (f"{r['prefill_tps'] / cpp['prefill_tps']:.2f}x, {r['decode_tps'] / cpp['decode_tps']:.2f}x"
                  if cpp else "-")
        spread = f"{r['decode_tps']:.1f} [{r['decode_tps_min']:.0f}-{r['decode_tps_max']:.0f}]"
        print(f"{name:<26} {r['ttft_ms']:>8.1f} {r['prefill_tps']:>14.1f} {spread:>20} {ratio:>18} {vs_cpp:>31}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "prompt_tokens": len(ids), "gen": args.gen,
                                         "runs": args.runs, "results": results}, indent=2))


if __name__ == "__main__":
    main()

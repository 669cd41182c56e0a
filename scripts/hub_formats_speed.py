"""Decode speed of SmolLM2 imported from Hub formats against the same model in localllm's own int4.

Writes SmolLM2-135M-Instruct (the embedded GGUF, exported to an fp32 HF folder) as a GPTQ repo
(4-bit, symmetric, group 32; with and without act order) and an AWQ repo (group 32, zero points), with
the packing of tests/test_hub_formats.py and their other tensors in float16 (as such repos hold them,
``lm_head`` included), then runs ``localllm bench --quant int4`` on each folder and on the float folder
(localllm's own int4, group 32: with its default int8 head, and with a 16-bit head as the repos keep
theirs), in interleaved rounds, and prints each one's median decode and prefill rates. Outputs go to
results/hub_formats_speed/.

    .venv/bin/python scripts/hub_formats_speed.py [--rounds 3] [--gen-tokens 32] [--compile]

--compile times each model's compiled decode step (what ``run`` uses once it is built; ``bench``
builds it before it times), not the eager one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_hub_formats import AWQ_ORDER, _int32, gptq_pack  # noqa: E402


def awq_pack_fast(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """tests.test_hub_formats.awq_pack, vectorized over the packed columns (the same bytes)."""
    out_f, in_f = w.shape
    wg = w.double().view(out_f, in_f // group, group)
    mn, mx = wg.amin(-1), wg.amax(-1)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half()
    zeros = torch.round(-mn / scales.double()).clamp(0, 15)
    q = torch.clamp(torch.round(wg / scales.double()[..., None]) + zeros[..., None], 0, 15).view(out_f, in_f)

    def pack(v: np.ndarray) -> torch.Tensor:  # (rows, out) -> (rows, out/8), AutoAWQ's order
        words = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
        for i in range(8):
            words |= v[:, AWQ_ORDER[i]::8] << np.uint64(4 * i)
        return _int32(words)

    return {"qweight": pack(q.long().t().numpy().astype(np.uint64)),
            "qzeros": pack(zeros.long().t().numpy().astype(np.uint64)), "scales": scales.t().contiguous()}


def write_repo(float_folder: Path, folder: Path, fmt: str) -> Path:
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(float_folder.glob("*.safetensors")):
        for name, w in load_file(str(path)).items():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                module = name.removesuffix(".weight")
                t = awq_pack_fast(w.float(), 32) if fmt == "awq" else gptq_pack(w.float(), 4, 32, True, fmt == "gptq-act", True)
                tensors.update({f"{module}.{k}": v for k, v in t.items()})
            else:
                tensors[name] = w.half()  # float16, as GPTQ and AWQ repos hold their other tensors
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((float_folder / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"} if fmt == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": fmt == "gptq-act",
              "checkpoint_format": "gptq"})
    (folder / "config.json").write_text(json.dumps(config))
    for extra in float_folder.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            (folder / extra.name).write_bytes(extra.read_bytes())
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="time the compiled decode step")
    args = ap.parse_args()
    from localllm.loaders.export_hf import export_hf_folder
    from localllm.paths import default_model_gguf

    out = ROOT / "results" / "hub_formats_speed"
    out.mkdir(parents=True, exist_ok=True)
    float_folder = out / "smollm2-fp32"
    if not (float_folder / "config.json").is_file():
        export_hf_folder(default_model_gguf(), float_folder, "fp32")
    models = {"own int4 (float -> int4 g32)": float_folder, "own int4, 16-bit head": float_folder}
    for fmt in ("gptq", "gptq-act", "awq"):
        folder = out / f"smollm2-{fmt}"
        if not (folder / "config.json").is_file():
            write_repo(float_folder, folder, fmt)
        models[fmt] = folder
    rates: dict[str, dict[str, list[float]]] = {m: {"decode": [], "prefill": []} for m in models}
    kernels: dict[str, str] = {}
    for r in range(args.rounds):
        for label, folder in models.items():
            report = out / f"{folder.name}{'-head16' if label.endswith('head') else ''}-{r}.json"
            cmd = [sys.executable, "-m", "localllm", "bench", str(folder), "--quant", "int4", "--device", "cpu",
                   "--no-quality", "--runs", "3", "--prompt-tokens", "64", "--gen-tokens", str(args.gen_tokens),
                   "--json", str(report)]
            if label.startswith("own"):
                cmd += ["--calibration", "none"] if "--calibration" in _bench_help() else []
            if label.endswith("16-bit head"):  # the bytes of the Hub repos, whose lm_head stays float
                cmd += ["--quant-head", "none"]
            if args.compile:
                cmd += ["--compile"]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            res = json.loads(report.read_text())["schemes"]["int4"]
            rates[label]["decode"].append(float(res["decode_tps"]["median"]))
            rates[label]["prefill"].append(float(res["prefill_tps"]["median"]))
            kernels[label] = f"{res['label']}; {res['activation_dtype']}; {res['kernels']}"
    for label, r in rates.items():
        print(f"{label:<30} decode {statistics.median(r['decode']):7.1f} tok/s   prefill "
              f"{statistics.median(r['prefill']):7.1f} tok/s   (decode by round: {', '.join(f'{x:.2f}' for x in r['decode'])})")
        print(f"{'':<30} {kernels[label]}")


def _bench_help() -> str:
    return subprocess.run([sys.executable, "-m", "localllm", "bench", "--help"], capture_output=True, text=True).stdout


if __name__ == "__main__":
    main()

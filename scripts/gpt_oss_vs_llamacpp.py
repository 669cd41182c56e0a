#!/usr/bin/env python
"""gpt-oss GGUF files checked against llama.cpp itself, on the tests' tiny random gpt-oss
(``tests/test_gpt_oss_gguf.py``'s ``oss_model``) saved as an HF folder:

1. llama.cpp's own ``convert_hf_to_gguf.py`` (F32) against the tests' GGUF writer: tensor names, types,
   shapes and bytes, and the ``gpt-oss.*`` metadata keys;
2. ``llama-quantize`` MXFP4_MOE of the converter's F16 file: every expert imports bit for bit;
3. next-token log-probabilities after prompts of 6-40 tokens (past the 8-token window): llama-server's
   top 8 against localllm's (the F32 GGUF, fp32) and transformers' with the model's YaRN
   (``truncate: false``) and with the ramp rounded (``truncate: true``, as ggml computes it).

    .venv/bin/python scripts/gpt_oss_vs_llamacpp.py --llama-cpp PATH/llama.cpp [--out results/gpt_oss_gguf]

PATH/llama.cpp is a source tree with ``build/bin/llama-quantize`` and ``llama-server`` built (the
llama-cpp-python sdist vendors one). The converter cannot hash the tiny byte-level tokenizer's
pre-tokenizer, so it is told gpt-oss's (``gpt-4o``); this assumes the tree's ``conversion/base.py``
layout (llama.cpp of 2026).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_CONVERT = """
import runpy, sys
sys.path[:0] = [{root!r}, {root!r} + '/gguf-py']
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-4o'
sys.argv = ['convert_hf_to_gguf.py', {folder!r}, '--outfile', {out!r}, '--outtype', {kind!r}]
runpy.run_path({root!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""


def hf_folder(out: Path):  # type: ignore[no-untyped-def]
    """The tiny model and its folder, with a byte-level tokenizer that has one merge (the converter
    writes merges only where the tokenizer has some)."""
    from tests.conftest import write_tiny_tokenizer
    from tests.test_gpt_oss_gguf import oss_model

    model = oss_model()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tiny_tokenizer(out, model.config.vocab_size)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["model"]["vocab"]["Ġt"] = len(tok["model"]["vocab"])
    tok["model"]["merges"] = [["Ġ", "t"]]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return model


def convert(root: Path, folder: Path, out: Path, kind: str) -> None:
    code = _CONVERT.format(root=str(root), folder=str(folder), out=str(out), kind=kind)
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def compare_writer(model, converted: Path, mine: Path) -> None:  # type: ignore[no-untyped-def]
    import gguf
    import numpy as np

    a, b = gguf.GGUFReader(str(converted)), gguf.GGUFReader(str(mine))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    names = set(ta) == set(tb)
    same = all(ta[k].tensor_type == tb[k].tensor_type and list(ta[k].shape) == list(tb[k].shape)
               and np.array_equal(np.asarray(ta[k].data), np.asarray(tb[k].data)) for k in ta if k in tb)
    ka = {k: a.fields[k].contents() for k in a.fields if k.startswith("gpt-oss.")}
    kb = {k: b.fields[k].contents() for k in b.fields if k.startswith("gpt-oss.")}
    print(f"converter vs tests' writer: {len(ta)} tensors, same names {names}, same types/shapes/bytes {same}, "
          f"same gpt-oss.* metadata {ka == kb}")


def experts_bit_for_bit(path: Path) -> None:
    import gguf
    import numpy as np

    from localllm.loaders.load import load_model
    from localllm.quant.expert_kernels import block_type

    lm = load_model(str(path), dtype="fp32")
    files = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    checked = exact = 0
    for i, layer in enumerate(lm.model.layers):
        ex = layer.mlp.experts
        for proj in ("gate", "up", "down"):
            t = files[f"blk.{i}.ffn_{proj}_exps.weight"]
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            p = getattr(ex, proj) if ex.gate_up is None or proj == "down" else ex.gate_up
            rows = slice(None)
            if p is ex.gate_up:
                f = ex.down.in_features
                rows = slice(0, f) if proj == "gate" else slice(f, 2 * f)
            held = gguf.GGMLQuantizationType[block_type(p)]
            got = np.stack([gguf.quants.dequantize(p.blocks[e, rows].numpy(), held) for e in range(want.shape[0])])
            checked += 1
            exact += bool(np.array_equal(got, want))
    print(f"{path.name}: {exact} of {checked} expert tensors bit for bit; {lm.tensor_import}")


def logprobs(root: Path, model, path: Path, port: int) -> None:  # type: ignore[no-untyped-def]
    import torch
    import transformers

    from localllm.loaders.load import load_model
    from tests.test_gpt_oss import tokens

    rounded_cfg = model.config.to_dict()
    rounded_cfg["rope_parameters"] = {**rounded_cfg["rope_parameters"], "truncate": True}
    rounded = transformers.GptOssForCausalLM(transformers.GptOssConfig.from_dict(rounded_cfg)).eval()
    rounded.load_state_dict(model.state_dict())
    lm = load_model(str(path), quant="fp32")
    bins = root / "build" / "bin"
    env = {**os.environ, "LD_LIBRARY_PATH": str(bins)}
    server = subprocess.Popen([str(bins / "llama-server"), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
                               "-c", "256", "-t", "1", "-np", "1", "--no-warmup"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.2)
        print("prompt  max |llama.cpp - x| over llama.cpp's top 8:  localllm   transformers   transformers "
              "(truncate: true)   |localllm - transformers| (all)")
        for n in (6, 12, 24, 40):
            ids = tokens(n, seed=n)[0].tolist()
            body = json.dumps({"prompt": ids, "n_predict": 1, "n_probs": 8, "temperature": 0,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            top = json.load(urllib.request.urlopen(req))["completion_probabilities"][0]["top_logprobs"]
            x = torch.tensor([ids])
            with torch.inference_mode():
                ours = lm.model(x)[0, -1].float().log_softmax(-1)
                hf = model(x).logits[0, -1].log_softmax(-1)
                hf_rounded = rounded(x).logits[0, -1].log_softmax(-1)
            d = [max(abs(t["logprob"] - v[t["id"]].item()) for t in top) for v in (ours, hf, hf_rounded)]
            print(f"{n:6d}  {'':42s}{d[0]:.1e}   {d[1]:.1e}        {d[2]:.1e}                  "
                  f"{(ours - hf).abs().max().item():.1e}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree with build/bin built")
    ap.add_argument("--out", type=Path, default=Path("results/gpt_oss_gguf"))
    ap.add_argument("--port", type=int, default=18777)
    args = ap.parse_args()
    from tests.test_gpt_oss_gguf import write_oss_gguf

    root, out = args.llama_cpp.resolve(), args.out.resolve()
    folder = out / "hf"
    model = hf_folder(folder)
    f32, f16, mxfp4 = out / "tiny-oss-f32.gguf", out / "tiny-oss-f16.gguf", out / "tiny-oss-mxfp4-moe.gguf"
    convert(root, folder, f32, "f32")
    convert(root, folder, f16, "f16")
    env = {**os.environ, "LD_LIBRARY_PATH": str(root / "build" / "bin")}
    subprocess.run([str(root / "build" / "bin" / "llama-quantize"), str(f16), str(mxfp4), "MXFP4_MOE"], check=True,
                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    compare_writer(model, f32, write_oss_gguf(model, out / "tests-writer-f32.gguf", "f32"))
    experts_bit_for_bit(mxfp4)
    logprobs(root, model, f32, args.port)


if __name__ == "__main__":
    main()

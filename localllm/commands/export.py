"""``localllm export NAME DIR``: a model as a Hugging Face folder, for engines beyond this machine."""

from __future__ import annotations

from pathlib import Path

import click

from localllm.commands.common import note
from localllm.errors import disk_errors
from localllm.format import human_size


@click.command()
@click.argument("model")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Float weights' dtype (quantized weights are dequantized into it unless --keep-quant).")
@click.option("--keep-quant", is_flag=True,
              help="Keep int4/int8 weights quantized, with a quantization config vLLM, SGLang and TGI read "
                   "(compressed-tensors), where the stored grid maps onto it exactly; refused where it does not.")
def export(model: str, folder: Path, dtype: str, keep_quant: bool) -> None:
    """Write MODEL (anything `run` takes) to FOLDER as an HF model folder: config.json, safetensors,
    tokenizer and chat template. Serve it with vLLM, SGLang or TGI (the same OpenAI API as `serve`)."""
    from localllm.loaders.export_hf import export_hf_folder
    from localllm.loaders.store import check_local_path

    check_local_path(model)
    with disk_errors(f"export to {folder}", "choose a folder you can write, on a disk with room"):
        folder.mkdir(parents=True, exist_ok=True)  # before loading: an unwritable folder fails at once
        if keep_quant:
            from localllm.loaders.export_hf import export_quantized_folder

            out = export_quantized_folder(model, folder, dtype)
        else:
            out = export_hf_folder(model, folder, dtype)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    note(f"exported {model} to {out} ({human_size(size)})")
    note(f"serve it elsewhere:  vllm serve {out}")

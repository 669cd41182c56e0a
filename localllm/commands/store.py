"""``localllm pull | list | show | rm``: the local model store from the command line.

The work is done in :mod:`loaders.pull` (fetching, converting, storing), :mod:`loaders.describe` (the
facts ``show`` prints) and :mod:`loaders.store`; these commands parse, call and print. Tables and
JSON go to stdout; progress, notes and summaries to stderr.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from localllm.commands.common import calibration_option, note, quant_head_option
from localllm.errors import LocalLLMError
from localllm.loaders.calibrate import PULL_CALIBRATION
from localllm.format import human_ago, human_count, human_size, table
from localllm.loaders.pull import (
    DEFAULT_PULL_SCHEME,
    PULL_SCHEMES,
    PullOptions,
    PullResult,
    find_stored,
    parse_source,
    pull_model,
)
from localllm.loaders.store import Store, StoredModel, check_length, check_local_path, looks_like_path


# =========================================================================== pull
@click.command()
@click.argument("source")
@click.option("--quant", "-q", default=None, metavar="|".join(PULL_SCHEMES),
              help=f"Weight scheme to store (default: {DEFAULT_PULL_SCHEME}; a quantized Hub repo (GPTQ, AWQ...) "
                   "or GGUF file (Q4_K_M...) keeps its own format, which naming a scheme re-quantizes).")
@click.option("--group-size", type=int, help="Group size (int4: 32/64/128/256, default 32; a Q4 GGUF keeps its own).")
@quant_head_option("Default: as stored; a float head quantized with the rest becomes int8.")
@calibration_option(PULL_CALIBRATION, "Default: auto: awq up to 1B parameters (calibrated once, when the model "
                                      "is stored: minutes), none above (hours on a CPU).")
@click.option("--name", help="Store name (default: the repo's or file's base name, lower case).")
@click.option("--revision", help="Branch, tag or commit of a Hub repo (same as REPO@REV).")
@click.option("--gguf", "gguf_file", metavar="FILE", help="Import this GGUF file of the Hub repo instead of its safetensors.")
@click.option("--prune", is_flag=True, help="Delete the downloaded float weights from the HF cache afterwards.")
@click.option("--force", is_flag=True, help="Pull and convert again even if already stored.")
def pull(source: str, quant: str | None, group_size: int | None, quant_head: str | None, calibration: str, name: str | None,
         revision: str | None, gguf_file: str | None, prune: bool, force: bool) -> None:
    """Download SOURCE, quantize it and store it.

    SOURCE is a Hub repo (ORG/NAME[@REV]), a local model folder or a local .gguf file.
    """
    from localllm.commands.compile_step import build_in_background
    from localllm.loaders.spec import LoadSpec
    from localllm.runtime.compiled_step import wanted_batch

    check_local_path(source)
    options = PullOptions(quant, group_size, quant_head, name, prune, force, calibration)
    result = pull_model(parse_source(source, revision, gguf_file), options, notify=note)
    print_pull(result)
    # the packages `run` uses: one sequence's steps, and its verify steps (speculation is on by default)
    if not result.kept and build_in_background(LoadSpec(result.entry.ref), wanted_batch(1, speculate=True)):
        note("compiling its decode step in the background (a few minutes on idle CPU time, once), so that runs "
             "decode at full speed")


def print_pull(result: PullResult) -> None:
    """The summary of a pull on stderr: what was fetched and converted in how long, and how to run it."""
    entry = result.entry
    if result.kept:
        note(f"'{entry.ref}' is already stored ({entry.size}); use --force to pull it again")
        note(f"run it:    localllm run {entry.ref}")
        return
    fetched = result.fetched
    assert fetched is not None
    what = "download" if fetched.downloaded else "read"  # local files: hashing and opening
    note(f"{what + ':':<10} {fetched.seconds:.2f}s ({human_size(fetched.nbytes)})")
    note(f"{'quantize:':<10} {result.quantize_s:.2f}s")
    calibration = entry.manifest.get("calibration")
    if calibration:  # data-aware int4: the part of the quantize time its calibration took
        note(f"{'calibrate:':<10} {calibration['seconds']:.2f}s ({calibration['method']}, "
             f"{calibration['tokens']} tokens)")
    note(f"{'stored:':<10} {entry.ref}, {entry.size}")
    if result.pruned_bytes is not None:
        note(f"{'pruned:':<10} {human_size(result.pruned_bytes)} of downloaded weights from the HF cache")
    note(f"{'run it:':<10} localllm run {entry.ref}")


# =========================================================================== list
def scheme_short(manifest: dict[str, Any]) -> str:
    """A stored scheme in a few characters: ``int4 g32``, ``int4 g32 sym``, ``int8``, ``nf4 b64``, ``bf16``,
    ``Q4_K`` (a GGUF file's blocks; ``Q4_K mix`` beside tensors of other types)."""
    quant = manifest.get("quant") or {}
    q = quant.get("scheme")
    if not q:
        return str(manifest.get("dtype") or manifest.get("scheme"))
    name, group = q["name"], q.get("group_size")
    if name == "gguf":
        return str(q.get("gguf_type")) + (" mix" if quant.get("overrides") else "")
    if name == "int4":
        return f"int4 g{group}" + (" sym" if q.get("symmetric") else "")
    if name == "nf4":
        return f"nf4 b{group}"
    return name + (f" g{group}" if group else "")


def list_json(entry: StoredModel) -> dict[str, Any]:
    """One ``list --json`` object: name (NAME:SCHEME), model, scheme, quant, size (bytes), modified (ISO 8601), source, path."""
    return {
        "name": entry.ref,
        "model": entry.name,
        "scheme": entry.scheme,
        "quant": (entry.manifest.get("quant") or {}).get("scheme"),
        "size": entry.size_bytes,
        "modified": entry.modified.isoformat(),
        "source": entry.manifest.get("source"),
        "path": str(entry.path),
    }


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of objects instead of the table.")
def list_models(as_json: bool) -> None:
    """List stored models."""
    entries = Store().list()
    if as_json:
        click.echo(json.dumps([list_json(e) for e in entries], indent=2))
        return
    rows = [["NAME", "SCHEME", "SIZE", "MODIFIED"]]
    rows += [[e.ref, scheme_short(e.manifest), e.size, human_ago(e.modified)] for e in entries]
    click.echo(table(rows))
    if not entries:
        note("no models stored yet; pull one with `localllm pull ORG/NAME`")


# =========================================================================== show
def show_text(facts: dict[str, Any]) -> str:
    """The text view of :func:`loaders.describe.describe`'s object, in sections like ``ollama show``."""
    from localllm.quant.formats import QuantScheme

    q = facts["quant"]
    scheme = QuantScheme(**q).label() if q else f"{facts['scheme']} (not quantized)"
    heads = f"{facts['heads']} ({facts['kv_heads']} kv heads, head dim {facts['head_dim']})"
    window = (f"; {facts['sliding_layers']} of {facts['layers']} layers hold only their {facts['sliding_window']}-token "
              f"window" if facts.get("sliding_layers") else "")
    kv = (f"{human_size(facts['kv_cache_bytes_per_token'])} per token, {human_size(facts['kv_cache_bytes_context'])} "
          f"for {facts['context_length']} tokens (16-bit cache{window})")
    # --kv-cache int8: a byte per value and an fp32 scale per token and kv head, instead of 2 bytes a value
    int8 = (facts["head_dim"] + 4) / (2 * facts["head_dim"])
    kv += (f"; int8 cache: {human_size(round(facts['kv_cache_bytes_per_token'] * int8))} per token, "
           f"{human_size(round(facts['kv_cache_bytes_context'] * int8))}")
    src = facts["source"]
    source_rows = ([("repo", src["repo"]), ("revision", src.get("revision") or "main"), ("commit", src.get("commit") or "?")]
                   if src.get("repo") else [("path", src.get("path", "?"))])
    source_rows += [(k, src[k]) for k in ("file", "sha256") if src.get(k)]
    if src.get("format"):  # a Hub-quantized repo: its format, as read from its quantization_config
        source_rows.append(("format", src["format"]["label"]))
    sections = {
        "Model": [("name", facts["name"] or "(not stored)"), ("architecture", facts["architecture"]),
                  ("parameters", human_count(facts["parameters"])), ("context length", facts["context_length"]),
                  ("embedding length", facts["embedding_length"]), ("layers", facts["layers"]),
                  ("attention heads", heads), ("vocabulary", facts["vocab_size"]),
                  *_moe_rows(facts),
                  ("chat template", "yes" if facts["chat_template"] else "no")],
        "Weights": [("scheme", scheme), ("quantized modules", facts["quantized_modules"]),
                    ("weight bytes", f"{human_size(facts['weight_bytes'])} ({facts['weight_bytes']:,} bytes)"),
                    ("kv cache", kv)],
        **({"Tensor types (as loaded)": list(facts["tensor_types"].items())} if facts.get("tensor_types") else {}),
        **_memory_plan_section(facts),
        **({"Compiled decode step": [("eager", e["note"]) for e in facts["eager_steps"]]}
           if facts.get("eager_steps") else {}),
        "Source": source_rows + ([("created", _created_text(facts["created"])), ("location", facts["path"])]
                                 if facts["created"] else []),
    }
    lines = []
    for title, rows in sections.items():
        lines += [f"  {title}"] + [f"    {k:<20}{v}" for k, v in rows] + [""]
    return "\n".join(lines).rstrip("\n")


def _moe_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """A Mixture-of-Experts model's rows: ``experts  128, 8 active a token (size 768), 48 of 48 layers``."""
    moe = facts.get("moe")
    if not moe:
        return []
    shared = f"; a shared expert of {moe['shared_expert_size']}" if moe.get("shared_expert_size") else ""
    return [("experts", f"{moe['experts']}, {moe['active']} active a token (size {moe['expert_size']}{shared}), "
                        f"{moe['sparse_layers']} of {facts['layers']} layers"),
            ("active parameters", human_count(moe["active_parameters"]))]


def _memory_plan_section(facts: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """``Memory plan (cpu, int4, 21 GB available)``: per context length the total and its parts, and
    whether it fits (:mod:`loaders.memory_plan`)."""
    plans = facts.get("memory_plan")
    if not plans:
        error = facts.get("memory_plan_error")
        return {"Memory plan": [("unavailable", error)]} if error else {}
    first = plans[0]
    title = f"Memory plan ({first['device']}, {first['scheme']}, {human_size(first['available'])} available)"
    rows = []
    for p in plans:
        parts = (f"weights {human_size(p['weights'] - p.get('host_weights', 0))} + KV cache {human_size(p['kv_cache'])} + activations "
                 f"{human_size(p['activations'])} + runtime {human_size(p['runtime'] + p['overhead'])}")
        verdict = "fits" if p["fits"] else "does not fit"
        rows.append((f"ctx {p['ctx']}", f"{human_size(p['total']):>7} = {parts}  {verdict}"))
        rows += [("", line) for line in (p.get("placement") or [])]  # a MoE on a GPU: where its parts live
    return {title: rows}


def _created_text(iso: str) -> str:
    when = datetime.fromisoformat(iso)
    return f"{when.astimezone().strftime('%Y-%m-%d %H:%M')} ({human_ago(when)})"


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="A JSON object instead of the text view.")
@click.option("--verify", is_flag=True, help="Re-hash the stored files against the manifest.")
def show(model: str, as_json: bool, verify: bool) -> None:
    """Show a model's details: a stored NAME[:SCHEME], a Hub ORG/NAME it was pulled from, a .gguf file or
    model folder by path, or 'smollm2'."""
    from localllm.loaders.describe import describe_ref

    check_local_path(model)
    store = Store()
    facts, entry = describe_ref(model, store)
    if verify:
        if entry is None:
            raise LocalLLMError(f"--verify checks stored models, and {model} is not one", "leave --verify out")
        store.verify(entry)  # a LocalLLMError names the first bad file
        facts["verified"] = True
        note(f"verified: {len(entry.manifest['files'])} files match their sha256")
    click.echo(json.dumps(facts, indent=2, default=str) if as_json else show_text(facts))


# =========================================================================== rm
@click.command()
@click.argument("models", nargs=-1, required=True)
def rm(models: tuple[str, ...]) -> None:
    """Remove stored models (NAME[:SCHEME]...).

    A bare name removes its default scheme (the one `run NAME` loads).  Every name is checked first, so a typo removes nothing.  Never asks for confirmation.
    """
    store = Store()
    entries: dict[Path, StoredModel] = {}
    for ref in models:
        check_length(ref)
        if looks_like_path(ref):
            raise LocalLLMError(f"'{ref}' is a path, and rm removes stored models by name",
                                "give NAME[:SCHEME] as `localllm list` shows it")
        entry = find_stored(store, ref)
        entries.setdefault(entry.path, entry)
    for entry in entries.values():
        store.remove(entry.ref)
        note(f"deleted '{entry.ref}' ({entry.size} freed)")
    if len(entries) > 1:
        note(f"{human_size(sum(e.size_bytes for e in entries.values()))} freed in all")

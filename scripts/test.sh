#!/usr/bin/env bash
# Install the dev extra and run the whole test suite (CPU; CUDA tests skip themselves without a GPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -k tokenizer
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
exec .venv/bin/python -m pytest -q "$@"

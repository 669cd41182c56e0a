#!/usr/bin/env bash
# The 7B-shape GPU bench (see scripts/bench_gpu.py); arguments are passed on, e.g. --runs 3.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/bench_gpu.py "$@"

#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one go (one device run): the CUDA tests (the Triton paged
# attention kernel against float64 references, real CUDA graphs against eager steps) and the CUDA dry
# run (tests/test_cuda_dryrun.py, which CI runs without a GPU: here it checks that fake and real CUDA
# agree on choices, shapes and syncs), then every int4/int8 kernel on the 7B layer shapes beside F.linear
# (scripts/linear_gpu.py: $OUT/linears.txt), then the 7B-shape bench: per scheme load, peak memory against
# the plan, TTFT of a 2,000-token prompt, decode tok/s and its share of the bandwidth measured in the
# same run (decode steps replayed from CUDA graphs); then the serving bench at 1, 8 and 16 streams on
# int4; then a MoE with its experts all on the GPU, half and all in CPU RAM (scripts/moe_gpu.py). One JSON
# ($OUT/bench/bench.json) and one table ($OUT/bench/table.txt), within 12 minutes.
# Figures and logs go to $OUT (default results/gpu).
#
#   bash scripts/gpu_checks.sh            # on a CUDA machine, from any folder
#
# On a machine without this project's venv, python3 must hold torch; packages it lacks (gguf,
# bitsandbytes for nf4) can be put as wheels in .whl/ and are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# A bare machine's python3 (no venv, nothing to fetch) has no localllm installed: for this run, runtime/,
# quant/ and loaders/ are linked into localllm/ as setup.cfg's package_dir maps them, and unlinked at exit.
links=()
if ! "$PY" -c "import localllm.runtime" 2>/dev/null; then
  for d in runtime quant loaders; do [ -e "localllm/$d" ] || { ln -s "../$d" "localllm/$d" && links+=("localllm/$d"); }; done
fi
trap 'rm -f "${links[@]}"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv; "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee "$OUT/machine.txt"
"$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || { echo "error: $PY sees no CUDA GPU" >&2; exit 1; }
schemes=fp16,int8,int4
"$PY" -c "import bitsandbytes" 2>/dev/null && schemes=$schemes,nf4
status=0
# --continue-on-collection-errors: a module that cannot import here must not hide the CUDA tests of the others.
# The whole log to $OUT (a failure's traceback comes back even when the run is cut short), its end here.
timeout 300 "$PY" -m pytest tests -m "cuda or cuda_dryrun" -q -rfE -p no:cacheprovider --continue-on-collection-errors \
  > "$OUT/pytest-cuda.txt" 2>&1 || status=1
tail -40 "$OUT/pytest-cuda.txt"
# Each int4/int8 kernel against F.linear on the 7B layer shapes (which one a scheme should take).
timeout 120 "$PY" scripts/linear_gpu.py --out "$OUT" 2>&1 | tee "$OUT/linears.log" | tail -20 || status=1
# A MoE (random Qwen3-MoE, int4) with its experts all on the GPU, half in CPU RAM (--n-cpu-moe), all there
# (--cpu-moe): prefill and decode tok/s of each ($OUT/moe.json).
timeout 240 "$PY" scripts/moe_gpu.py --out "$OUT" 2>&1 | tee "$OUT/moe.log" | tail -12 || status=1
timeout 300 "$PY" scripts/bench_gpu.py --quant "$schemes" --runs 3 --prompt-tokens 2000 --serving 1,8,16 \
  --out "$OUT/bench" 2>&1 \
  | tee "$OUT/bench.log" | tail -30 || status=1
exit $status

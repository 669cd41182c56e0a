"""``localllm bench``: memory, speed and quality of weight schemes, measured side by side in one process.

    settings        what to measure (Settings), its checks, the evaluation text
    machine         the machine's description, load and memory bandwidth
    meters          peak memory growth (resident set on the CPU, allocations on CUDA)
    runs            one scheme: load, timed generations, memory, KV cache figures
    quality         each scheme against the highest-precision one
    measure         the whole run (run_bench, bench_checkpoint) and its JSON schema
    random_weights  random-weight models made on the device (scripts/bench_gpu.py)
    report, plot    the table, JSON and PNG

The names below are the package's API (``localllm bench`` and scripts/bench_gpu.py use them).
"""

from localllm.bench.machine import busy_warning
from localllm.bench.measure import SCHEMA, bench_checkpoint, run_bench
from localllm.bench.meters import RSSMeter, release_memory
from localllm.bench.plot import require_matplotlib, write_plot
from localllm.bench.random_weights import random_model
from localllm.bench.report import format_table, report, require_writable, write_json
from localllm.bench.settings import (
    EVAL_TEXT,
    KV_REPORT_STEPS,
    PRECISION_ORDER,
    Settings,
    baseline_scheme,
    check_settings,
    parse_schemes,
)
from localllm.threads import set_threads

__all__ = [
    "EVAL_TEXT", "KV_REPORT_STEPS", "PRECISION_ORDER", "RSSMeter", "SCHEMA", "Settings", "baseline_scheme",
    "bench_checkpoint", "busy_warning", "check_settings", "format_table", "parse_schemes", "random_model",
    "release_memory", "report", "require_matplotlib", "require_writable", "run_bench", "set_threads", "write_json",
    "write_plot",
]

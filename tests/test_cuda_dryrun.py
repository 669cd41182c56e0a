"""The CUDA path, checked on any machine: a dry run on a fake CUDA device.

No GPU is needed. Under ``FakeTensorMode`` tensors can live on a fake ``cuda`` device and every op
runs its meta kernel: shapes, dtypes and devices are checked, nothing is computed. The dry run loads
the supported families in the schemes the CUDA path offers (fp16, bf16, int8, int4, nf4) onto "a CUDA
device of capability 8.9" (:class:`quant.target.Target`, passed to ``load_model``: the kernel choice
never asks ``torch.cuda``), runs a whole-sequence forward (``model(tokens)``, no cache) and three
batch steps' paged forwards over a :class:`runtime.kv_pool.KVPool` on the device (prefill chunks, one
of which does not sample, then steps of single queries past Mistral's window; Gemma 3's layer groups
each with their block tables), then the batch engine's token loop (chunked prefill, a greedy and a
sampled request with a repeat penalty) and one ``Engine`` generation, and checks that

* every quantized layer runs the kernel the CUDA selection offers (never the reference), and every
  parameter, buffer and KV pool tensor is on the device;
* logits have the shapes and dtypes the CPU path gives for the same model, and the matmuls, attention
  and embedding give the activation dtype (no float32 slip);
* the CUDA kernels' own argument checks hold (the ``TORCH_CHECK`` calls of ``int4mm.cu`` and
  ``int8mm.cu``, which the meta kernels leave out: a wrong tinygemm layout fails here; localllm's
  Triton int8/int4 op checks its layouts in its fake as in its launch);
* a forward makes no host sync and no blocking copy (a batch step's forward: device ops alone; a
  whole sequence works its RoPE frequencies out on the host and sends them up without blocking),
  and the engine's steps read nothing back beyond the sampled ids: one transfer at the end of each
  step, no blocking upload (see :class:`Audit`). ``Engine`` (what ``run`` uses) is the same
  BatchEngine with a one-sequence pool and chunks of the window: its steps pass the same check;
* a batch step's attention on CUDA is one call per layer of the Triton paged kernel
  (:mod:`runtime.cuda_attention`, its fake run here; its numerics are ``tests/test_cuda_attention.py``'s),
  for prefill chunks and decode rows alike: no block is gathered and SDPA never runs;
* the engines' decode-only steps go through the CUDA graphs' static buffers (:mod:`runtime.cuda_graphs`,
  buckets 1, 2 and 4 for four sequences; a graph's function rerun at each replay, as capturing needs
  a real GPU), with the same checks of their steps: the buckets used are asserted;
* SmolLM2's real widths (576: not a multiple of 128) run on the Triton int4 kernel, and on tinygemm
  (4 k-tiles a pack) when it is named;
* a 7B-shape Llama's weights (fp16, int4) and KV pools (one 4096-token sequence's, a 1 GiB budget's)
  take the bytes the arithmetic says, counted from the fake tensors (nothing real is allocated).

What it cannot see, and ``scripts/gpu_checks.sh`` (which runs this file too) checks on a real GPU:
numbers (the kernels' check against the reference is skipped: ``check_kernels=False``; what
``_weight_int4pack_mm``, ``_weight_int8pack_mm`` and SDPA compute), whether torch has a CUDA kernel
for an op at all (the meta kernel answers for every device), bitsandbytes' CUDA code (its ops'
registered fakes run instead), which SDPA backend CUDA picks, ``torch.compile`` and the compiled
step (:mod:`runtime.compiled_step`: every step here runs eagerly), the speed of anything. Sampling
with a seed needs a CUDA ``torch.Generator``, which a CPU-only torch cannot make: the dry run samples
unseeded.

On a CPU-only torch a few Python bindings (``copy_``, indexing, ``bool()``) open a CUDA device guard,
which such a build lacks; ``tests/csrc/fake_cuda_guard.cpp`` puts c10's fake guard in place for the
dry run (built with the C++ compiler localllm's kernels use; without one these tests skip, saying so).
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import importlib.util
import itertools
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch._subclasses.fake_tensor as fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from localllm import native
from localllm.loaders import load as load_module
from localllm.loaders.build import empty_model, fuse_projections, load_weights
from localllm.loaders.load import load_model
from localllm.quant import kernels
from localllm.quant.formats import parse_scheme
from localllm.quant.linear import QuantLinear, make_plan, swap_linears
from localllm.quant.target import Target
from localllm.loaders.memory_plan import Footprint, plan_for
from localllm.runtime import cuda_attention
from localllm.runtime.cuda_graphs import GraphedDecode, eager_capture
from localllm.runtime.batch import BatchEngine
from localllm.runtime.config import ModelConfig
from localllm.runtime.engine import Engine, sequence_engine
from localllm.runtime.kv_pool import KVPool, cache_bytes, plan_pool
from localllm.runtime.model import cache_rope_tables
from localllm.runtime.paged import PagedStep
from localllm.runtime.scheduler import Chunk
from tests.engines import step_chunk
from localllm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cuda_dryrun

aten = torch.ops.aten
#: The device the dry run loads onto: an Ada GPU (tinygemm needs sm80+).
GPU = Target(torch.device("cuda"), (8, 9))
SCHEMES = ("fp16", "bf16", "int8", "int4", "nf4")
#: nf4's layers are bitsandbytes' (a dependency, but a bare GPU machine may run this file without it).
NO_BNB = importlib.util.find_spec("bitsandbytes") is None


def scheme_param(*values: str):  # type: ignore[no-untyped-def]
    """A parametrize case, skipped when it is nf4 and bitsandbytes is not installed."""
    return pytest.param(*values, marks=pytest.mark.skipif(
        NO_BNB and "nf4" in values, reason="nf4 runs on bitsandbytes, which is not installed here"))


#: The kernel the CUDA selection must give each quantized scheme's layers.
CUDA_KERNEL = {"int8": "int8-triton-cuda", "int4": "int4-triton-cuda", "nf4": "nf4-bitsandbytes"}
#: Kernels a case names (``int4+tinygemm``: int4 weights on ``--kernel int4-tinygemm-cuda``), so that the
#: kernels taken only when named keep their checks too (tinygemm's layout, below).
NAMED = {"tinygemm": "int4-tinygemm-cuda", "int8pack": "int8-weight-only"}


def parse_case(case: str) -> tuple[str, str | None, int]:
    """``scheme[+kernel][:gpu]`` -> (scheme, the kernel named or None, the GPU's index)."""
    base, _, index = case.partition(":")
    scheme, _, named = base.partition("+")
    return scheme, NAMED[named] if named else None, int(index or 0)


#: Tiny families wide enough for tinygemm (inputs a multiple of 128); Mistral with a window shorter
#: than the prompts, so the windowed masks run too.
FAMILIES = {"llama": {}, "mistral": {"sliding_window": 8}, "qwen2": {},
            # sliding and full layers: a paged pool of four layer groups, each with its block tables
            "gemma3": {"sliding_window": 8, "num_hidden_layers": 4, "head_dim": 64, "pad_token_id": 0,
                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                       "sliding_attention"]}}
WIDE = dict(hidden_size=256, intermediate_size=512)
PROMPTS = ([1, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [1, 4, 6])  # 12 tokens (past the window) and 3


# --------------------------------------------------------------------------- the fake CUDA device
GUARD_SOURCE = Path(__file__).resolve().parent / "csrc" / "fake_cuda_guard.cpp"


def fake_cuda_guard_library(cache_dir: Path) -> ctypes.CDLL:
    """``tests/csrc/fake_cuda_guard.cpp`` built (about a second, once a session) and loaded."""
    from torch.utils.cpp_extension import include_paths, library_paths

    key = hashlib.sha256(GUARD_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    out = cache_dir / f"fake_cuda_guard-{key}.so"
    if not out.exists():
        cxx = native.compiler()
        if cxx is None:
            pytest.skip("the dry run needs a C++ compiler (g++) on a CPU-only torch, for its CUDA device guard")
        lib = library_paths()[0]
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([*cxx, str(GUARD_SOURCE), "-o", str(tmp), "-shared", "-fPIC", "-O1", "-std=c++17",
                        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                        *(f"-I{p}" for p in include_paths()), f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10"],
                       check=True, capture_output=True)
        os.replace(tmp, out)
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def fake_cuda(kernels_dir):
    """A CUDA device guard where torch has none (see the module's docstring), for this module only."""
    if torch.backends.cuda.is_built():
        yield  # a CUDA build: FakeTensorMode puts its own guard in place when no GPU is visible
        return
    guard = fake_cuda_guard_library(kernels_dir)
    assert guard.localllm_fake_cuda_guard(1) == 1, "a CUDA device guard is registered in a CPU-only torch"
    yield
    guard.localllm_fake_cuda_guard(0)


class DryRunMode(FakeTensorMode):
    """FakeTensorMode that acts the same whether or not a GPU is visible. With one visible, torch's own
    mode lets ``torch.tensor(data, device="cuda")`` make a real GPU tensor (a copy up that no op shows,
    so the audit could not see a blocking upload: found on the first real GPU); here such data is made
    on the host and lifted, and its move to the device is the op the audit sees, as without a GPU."""

    @property
    def avoid_device_init(self) -> bool:
        return True


@pytest.fixture
def fake(fake_cuda, monkeypatch):
    """A fresh :class:`DryRunMode`. Constant propagation is off: with it, ``.item()`` of a tensor made
    from a Python number answers without complaint (a sync that would go unseen), and a one-element
    ``torch.tensor(..., device="cuda")`` under inference mode runs a real CUDA copy."""
    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", -1)
    return DryRunMode(allow_non_fake_inputs=True)


def _on_host(items: Iterator) -> Iterator:
    """Each item made with the fake mode suspended: real CPU tensors, read and quantized on the host."""
    while True:
        with unset_fake_temporarily():
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


@pytest.fixture
def host_checkpoints(monkeypatch):
    """``load_model``'s checkpoints read their files (and quantize) on the host, as they do before a
    real run copies each tensor to the GPU: the fake mode covers the device side only, from
    ``load_weights``' ``t.to(device)`` on. (A reader's ``torch.empty`` made under the fake mode would
    be fake, and numpy cannot fill it.) Nothing else of the checkpoint changes."""
    real = load_module.open_checkpoint

    def open_on_host(ref, store=None):
        ckpt = real(ref, store)
        base = type(ckpt)
        host = type(f"Host{base.__name__}", (base,), {
            "iter_tensors": lambda self, *args, **kw: _on_host(base.iter_tensors(self, *args, **kw)),
            "iter_canonical": lambda self, plan, tied: _on_host(base.iter_canonical(self, plan, tied)),
        })
        ckpt = copy.copy(ckpt)
        ckpt.__class__ = host
        return ckpt

    monkeypatch.setattr(load_module, "open_checkpoint", open_on_host)


# --------------------------------------------------------------------------- what the device sees
def _arg(func, args, kwargs, name, default=None):
    """Argument ``name`` of an op call, given by position or keyword."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else default
    return default


#: Ops that move a tensor between devices (what they do depends on the devices).
TRANSFERS = {aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.to.other, aten.copy_.default}
#: Ops that read a value back to Python.
READS = {aten._local_scalar_dense.default, aten.item.default}
#: Ops whose output dtype is the activation dtype: a float32 slip shows here. (Under inference mode,
#: as the runtime runs, composite ops such as linear and SDPA reach the mode whole.)
MATMULS = {"aten.linear.default", "aten._weight_int4pack_mm.default", "aten._weight_int8pack_mm.default",
           "localllm.int_mm_cuda.default", "localllm.gguf_mm_cuda.default",
           "aten.scaled_dot_product_attention.default", "aten.embedding.default",
           "bitsandbytes.gemm_4bit.default", "bitsandbytes.gemv_4bit.default",
           "localllm.paged_span_attention.default"}


def _check_cuda_kernel(func, args) -> None:
    """The argument checks of torch's CUDA kernels (aten/src/ATen/native/cuda/int4mm.cu, int8mm.cu)
    that their meta kernels leave out: a layout the real kernel would refuse fails the dry run."""
    if func is aten._convert_weight_to_int4pack.default:
        w, inner = args
        assert w.dim() == 2 and w.dtype == torch.uint8 and w.is_contiguous(), "int4pack: w [n][k/2] uint8, contiguous"
        assert inner in (2, 4, 8), f"int4pack: innerKTiles {inner} not 2, 4 or 8"
        assert (w.shape[1] * 2) % (inner * 16) == 0, f"int4pack: k={w.shape[1] * 2} not a multiple of {inner * 16}"
    elif func is aten._weight_int4pack_mm.default:
        a, b, group, sz = args
        m, k = a.shape
        inner = b.shape[3] * 2
        n = b.shape[0] * 8
        assert a.device == b.device == sz.device, "int4mm: A, B and scales on one device"
        assert inner in (2, 4, 8), f"int4mm: B's innerKTiles {inner}"
        assert a.dtype == torch.bfloat16 and a.is_contiguous() and a.dim() == 2, "int4mm: A bf16, 2D, contiguous"
        assert b.dtype == torch.int32 and b.is_contiguous() and b.dim() == 4, "int4mm: B int32, 4D, contiguous"
        assert b.shape[1] == k // (inner * 16) and b.shape[2] == 32, f"int4mm: B {tuple(b.shape)} for k={k}"
        assert group in (32, 64, 128, 256), f"int4mm: group {group}"
        k_tiles = -(-k // 16)
        assert k_tiles * 16 >= group and (k_tiles * 16) % group == 0, f"int4mm: k={k}, group {group}"
        assert k_tiles % inner == 0, f"int4mm: {k_tiles} k-tiles not a multiple of innerKTiles {inner}"
        assert sz.dim() == 3 and sz.shape[1] == n and sz.shape[2] == 2, f"int4mm: scales {tuple(sz.shape)}, n={n}"
        assert sz.shape[0] == k // group and sz.dtype == torch.bfloat16, f"int4mm: scales {tuple(sz.shape)} {sz.dtype}"
    elif func is aten._weight_int8pack_mm.default:
        x, w, s = args
        assert x.dim() == 2 and w.dim() == 2 and s.dim() == 1, "int8mm: x, w 2D, scales 1D"
        assert x.shape[1] == w.shape[1] and w.shape[0] == s.shape[0], "int8mm: K and N agree"


class Audit(TorchDispatchMode):
    """Every op a block runs, seen just above the fake mode.

    ``events`` (phase, kind, op), kinds:

    * ``read``: a value read back to Python (``.item()``, ``.tolist()`` (one per element), ``bool(t)``):
      the host waits for the GPU. Answered with ``token`` when it is set (sampling's reads), else the
      fake mode raises DataDependentOutputException (a forward must have none);
    * ``h2d``: a blocking copy from the host (``torch.tensor(..., device="cuda")``, ``t.to("cuda")``):
      a pageable copy synchronises the stream unless ``non_blocking``;
    * ``h2d-async``: the same, ``non_blocking``;
    * ``d2h``: a copy to the host;
    * ``off-device``: a tensor off the model's GPU in a device op (0-dim CPU scalars excepted: they
      ride as kernel arguments), another GPU included;
    * ``host``: an op on host tensors alone (work out on the CPU: no transfer, no wait for the GPU);
    * ``op``: any other op (so that "nothing after the reads" can be checked).

    ``dtypes``: the output dtypes of the matmuls, attention and embedding, by phase.
    """

    def __init__(self, token: int | None = None, device: torch.device = torch.device("cuda", 0)) -> None:
        super().__init__()
        self.token, self.device = token, device
        self.phase = ""
        self.events: list[tuple[str, str, str]] = []
        self.dtypes: dict[str, set[torch.dtype]] = {}

    @contextmanager
    def during(self, phase: str) -> Iterator["Audit"]:
        saved, self.phase = self.phase, phase
        try:
            with self:
                yield self
        finally:
            self.phase = saved

    def kinds(self, phase: str | None = None) -> Counter[str]:
        return Counter(k for p, k, _ in self.events if phase is None or p == phase)

    def of(self, kind: str, phase: str | None = None) -> list[str]:
        return [op for p, k, op in self.events if k == kind and (phase is None or p == phase)]

    def _add(self, kind: str, func) -> None:
        self.events.append((self.phase, kind, str(func)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self._add("read", func)
            if self.token is not None:
                return self.token
            return func(*args, **kwargs)
        _check_cuda_kernel(func, args)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func in (aten.lift_fresh.default, torch.ops.prim.device.default) or (
                func is aten.detach_.default and args[0].device.type == "cpu"):
            return out  # torch.tensor(data) made on the host: the transfer that follows is what counts
        if str(func) in MATMULS and outputs:
            self.dtypes.setdefault(self.phase, set()).add(outputs[0].dtype)
        if func in TRANSFERS:
            src = _arg(func, args, kwargs, "src") if func is aten.copy_.default else args[0]
            dst = args[0] if func is aten.copy_.default else outputs[0]
            if src.device.type == "cpu" and dst.device.type == "cuda":
                blocking = not _arg(func, args, kwargs, "non_blocking", False)
                self._add("h2d" if blocking else "h2d-async", func)
                return out
            if src.device.type == "cuda" and dst.device.type == "cpu":
                self._add("d2h", func)
                return out
        tensors = inputs + outputs
        if tensors and all(t.device.type == "cpu" for t in tensors):
            self._add("host", func)
            return out
        off = [t for t in tensors if t.device != self.device and not (t.device.type == "cpu" and t.dim() == 0)]
        self._add("off-device" if off else "op", func)
        return out


def assert_on_device(tensors, device: torch.device = torch.device("cuda", 0)) -> None:
    bad = [(n, type(t).__name__, str(t.device)) for n, t in tensors
           if not (isinstance(t, FakeTensor) and t.device == device)]
    assert not bad, f"not on the fake CUDA device: {bad[:5]}"


def model_tensors_of(model) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


def assert_cuda_kernels(model, scheme: str, kernels_used: Counter | None = None, named: str | None = None) -> None:
    """Every quantized layer runs the CUDA selection's kernel for its scheme (or the kernel ``named``
    for the layers of ``scheme``; the int8 head beside int4 or nf4 layers its own), never the reference."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if scheme in CUDA_KERNEL:
        assert layers
        want = {n: named or CUDA_KERNEL[scheme] if m.scheme.name == scheme else CUDA_KERNEL[m.scheme.name]
                for n, m in layers}
        wrong = [(n, m.kernel.name) for n, m in layers if m.kernel.name != want[n]]
        assert not wrong, f"{scheme} layers on another kernel than {want}: {wrong[:4]}"
        assert all(m.kernel.device_type in (None, "cuda") for _, m in layers)
    else:
        assert not layers
    if kernels_used is not None:
        assert "reference" not in kernels_used and "attention-cpu" not in kernels_used, kernels_used


# --------------------------------------------------------------------------- one run of the runtime
#: The forwards :func:`run_runtime` audits: a whole sequence, then three batch steps' paged forwards
#: (prefill chunks; a prompt's last token beside a decode token; decode tokens alone).
FORWARDS = ("whole", "prefill", "queries", "decode")
#: The batch steps' forwards: attention over the paged pool.
PAGED = FORWARDS[1:]
#: The CUDA paged attention kernel's op (:mod:`runtime.cuda_attention`), as the audit names it.
SPAN_OP = "localllm.paged_span_attention.default"


def paged_steps(n_groups: int) -> dict[str, list[Chunk]]:
    """Three batch steps of two sequences, each holding one block per layer group (sequence ``s``'s
    block in group ``g`` is ``2 g + s``): the 12-token prompt that samples and the first 2 tokens of the
    3-token one that does not; then one query each, twice (the second prompt's last token beside the
    first one's first decode token; then a decode token each), past Mistral's window: its windowed
    masks run."""
    def chunk(s: int, tokens: list[int], start: int, logits: bool = True) -> Chunk:
        tables = [[2 * g + s] for g in range(n_groups)]
        return step_chunk(tokens, start, tables[0], logits, tuple(tables[1:]))

    a, b = PROMPTS
    return {"prefill": [chunk(0, a, 0), chunk(1, b[:2], 0, False)],
            "queries": [chunk(0, [3], len(a)), chunk(1, b[2:], 2)],
            "decode": [chunk(0, [3], len(a) + 1), chunk(1, [3], len(b))]}


def run_runtime(model, tokenizer=None) -> dict:
    """A whole-sequence forward and three batch steps' paged forwards on ``model`` (on the fake GPU,
    inside the fake mode, or for real on the CPU); then, given the ``tokenizer`` (on the fake GPU), the
    batch engine's token loop (chunked prefill, a greedy and a sampled request with a repeat penalty)
    and one ``Engine`` generation (a sampled one: ``run``'s path). Returns the shapes and dtypes of the
    logits and of the KV pool's tensors and, on the fake GPU, the :class:`Audit` of the forwards and of
    the loops."""
    device = model.device
    fake = device.type == "cuda"
    audit, looped = Audit(device=device), Audit(token=3, device=device)  # reads answered with token id 3
    forward = audit.during if fake else _nothing
    out: dict = {"audit": audit if fake else None, "loops": looped if fake and tokenizer is not None else None}

    # a whole sequence, no cache (perplexity, the transformers comparison): no read, no blocking copy
    tokens = torch.tensor([PROMPTS[0]], device=device)
    with forward("whole"), torch.inference_mode():
        logits = model(tokens)
    out["whole"] = (tuple(logits.shape), logits.dtype)

    # a batch step's paged forward over the engine's pool (a layer group's table per chunk: Gemma 3)
    engine = BatchEngine(model, kv_budget_bytes=cache_bytes(model.config, 128, torch.bfloat16), max_running=4)
    if fake:  # the Triton span kernel, never the CPU's (the dev extra installs Triton, as torch's CUDA builds do)
        assert engine.kernel is cuda_attention.paged_span_attention, engine.kernel
    cos, sin = (t.to(model.dtype) for t in cache_rope_tables(model.config, 64, device))
    for phase, specs in paged_steps(len(engine.plan.windows)).items():
        step, ids = PagedStep.build(engine.pool, specs, cos, sin, engine.kernel)
        with forward(phase), torch.inference_mode():  # as the engine runs it
            logits = model(ids, step)
        out[phase] = (tuple(logits.shape), logits.dtype)
    out["pool"] = [(tuple(t.shape), t.dtype, str(t.device)) for t in (engine.pool.k[0], engine.pool.v[0])]
    del engine, step
    if out["loops"] is None:
        return out

    # the token loops, sampling included: the reads are the sampled ids
    loop = looped.during
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20, repeat_penalty=1.1)
    budget = cache_bytes(model.config, 128, torch.bfloat16)
    engine = BatchEngine(model, kv_budget_bytes=budget, max_running=4, chunk_tokens=8)  # 12 tokens: 2 chunks
    # Decode-only steps through the CUDA graphs' static buffers, as a GPU replays them; capturing needs
    # a real GPU, so here the function a graph would capture runs at each replay (set in place of the
    # engine's own, which a machine with a GPU makes, before any step could capture).
    engine.runner.graphs = graphed(engine)
    handles = [engine.submit(PROMPTS[0], greedy, max_tokens=2), engine.submit(PROMPTS[1], sampled, max_tokens=2)]
    steps = []
    while True:
        with loop(f"step{len(steps)}"):
            n = engine.step()
        if not n:
            break
        steps.append(n)
    out["steps"] = steps
    out["engine"] = [(h.stats.finish_reason, h.stats.generated_tokens) for h in handles]
    out["graphs"] = (engine.graphs.buckets, engine.graphs.captured)
    del engine, handles

    # one sequence through Engine (what `run` does): its one-sequence BatchEngine's steps, each audited
    one = Engine(model, tokenizer, 64)
    one.batch.runner.graphs = graphed(one.batch)
    driven = one.batch.step
    count = itertools.count()

    def audited_step() -> int:
        with loop(f"sequence{next(count)}"):
            return driven()

    one.batch.step = audited_step  # what the handle's iteration calls
    out["sequence"] = list(one.generate_ids(PROMPTS[0], sampled, max_tokens=2, stop_ids=()))
    out["sequence_stats"] = (one.stats.finish_reason, one.stats.generated_tokens)
    out["sequence_graphs"] = one.batch.graphs.captured
    return out


def graphed(engine: BatchEngine) -> GraphedDecode:
    """``engine``'s decode-only steps through CUDA graphs' static buffers, rerun at each replay."""
    return GraphedDecode(engine.model, engine.pool, engine.kernel, engine.runner.cos, engine.runner.sin,
                         engine.scheduler.max_running, capture=eager_capture)


@contextmanager
def _nothing(phase: str) -> Iterator[None]:
    yield


def gathers(audit: Audit, phase: str) -> int:
    """The block gathers (``index_select`` copies of pool rows: :func:`runtime.kv_pool.gather`) in ``phase``."""
    return sum(op == "aten.index_select.default" for op in audit.of("op", phase))


def check_steps(loops: Audit, prefix: str) -> int:
    """Each engine step (phases ``prefix0``, ``prefix1``, ...) ends in its one read of the sampled ids
    (one per sampling sequence); nothing is copied up blocking, and nothing runs on the device after
    the reads. Returns the reads."""
    phases = list(dict.fromkeys(p for p, _, _ in loops.events if p.startswith(prefix)))
    assert phases, f"no {prefix} step ran"
    reads = 0
    for phase in phases:
        events = [k for p, k, _ in loops.events if p == phase]
        assert "h2d" not in events, f"{phase}: {Counter(events)}"
        assert events.count("h2d-async") <= 2, f"{phase}: {Counter(events)}"  # the step's indices, recent ids
        if "read" in events:
            first = events.index("read")
            assert set(events[first:]) == {"read"}, f"{phase}: device work after reading the tokens"
        reads += events.count("read")
    return reads


def check_audit(run: dict, n_layers: int) -> None:
    """No sync in any forward; the token loops read back only the sampled ids (see :class:`Audit`)."""
    audit, loops = run["audit"], run["loops"]
    for phase in FORWARDS:
        kinds = audit.kinds(phase)
        # A whole sequence works out its RoPE tables in the call: the frequencies on the host, sent up
        # without blocking (one upload a RoPE base: Gemma 3's local layers have their own). A batch
        # step's forward is handed its RoPE rows: device ops alone.
        allowed = {"op", "host", "h2d-async"} if phase == "whole" else {"op"}
        odd = [e for e in audit.events if e[0] == phase and e[1] not in ("op", "host")][:6]
        assert set(kinds) <= allowed and kinds["h2d-async"] <= 2, f"{phase}: {dict(kinds)}: {odd}"
        assert audit.dtypes[phase] == {run[phase][1]}, f"{phase}: matmul/attention dtypes {audit.dtypes[phase]}"
    # Attention on CUDA: every span of a batch step (prefill chunks, a prompt's last token beside a
    # decode row, decode rows) in one call of the Triton paged kernel per layer, which reads keys and
    # values where they lie in their blocks: no block is gathered, and SDPA never runs.
    for phase in PAGED:
        n, calls = gathers(audit, phase), audit.of("op", phase).count(SPAN_OP)
        sdpa = audit.of("op", phase).count("aten.scaled_dot_product_attention.default")
        print(f"{phase}: {calls} paged attention calls, {n} block gathers, {sdpa} SDPA ({n_layers} layers)")
        assert (calls, n, sdpa) == (n_layers, 0, 0), (phase, calls, n, sdpa)
    if loops is None:
        return
    stray = loops.of("off-device") + loops.of("d2h") + loops.of("host")
    assert not stray, stray[:6]
    reads = check_steps(loops, "step")
    assert reads == sum(n for _, n in run["engine"]), (reads, run["engine"])  # one per sampled token
    assert run["engine"] == [("length", 2), ("length", 2)]
    # max_running 4: graphs for 1, 2 and 4 sequences; the one decode-only step (both sequences) replayed 2
    print(f"CUDA graph buckets {run['graphs'][0]}, captured {run['graphs'][1]}")
    assert run["graphs"] == ((1, 2, 4), (2,)), run["graphs"]
    # Engine: the same BatchEngine (one sequence, its pool sized for it, chunks of the window), so the
    # same checks of its steps.
    assert check_steps(loops, "sequence") == 2 and run["sequence"] == [3, 3]
    assert run["sequence_stats"] == ("length", 2) and run["sequence_graphs"] == (1,)


# --------------------------------------------------------------------------- tiny models of each family
@pytest.fixture(scope="module")
def wide_folders(tiny_folder):
    def get(family: str) -> Path:
        return tiny_folder(family, **WIDE, **FAMILIES[family])[1]

    return get


#: Every scheme on Llama; Mistral (sliding-window masks) and Qwen2 (q/k/v biases, added by float and
#: quantized layers alike) with a float and a quantized scheme each, Gemma 3 (layers of two windows,
#: so a paged pool of layer groups) with one: what a family changes is
#: attention and biases, the same code whatever the weights' scheme. (The whole grid takes twice as
#: long: the file is kept within a minute on two cores.) One case runs on the second GPU, cuda:1: a
#: tensor put on the default GPU instead of the model's would show there. tinygemm, taken only when
#: named, runs once (its layout's checks: :func:`_check_cuda_kernel`).
CASES = [scheme_param("llama", s) for s in SCHEMES] + [("llama", "int4+tinygemm"), ("mistral", "bf16"),
                                                       ("mistral", "int4"), ("qwen2", "fp16"),
                                           ("qwen2", "int8:1"), ("gemma3", "int4")]


@pytest.mark.parametrize("family,case", CASES)
def test_a_family_runs_its_cuda_path_on_a_fake_gpu(family, case, wide_folders, fake, host_checkpoints):
    scheme, named, index = parse_case(case)
    device = torch.device("cuda", index)
    if torch.cuda.is_available() and torch.cuda.device_count() <= device.index:
        # A CUDA build with a real GPU keeps its real device guard, which refuses a GPU that is not there.
        pytest.skip(f"{device} is not on this machine, whose CUDA device guard is real")
    folder = str(wide_folders(family))
    # Rounded to nearest on both sides: AWQ's calibration computes on real host tensors, which the fake
    # mode does not give (its GPU side is left to a lent device)
    with fake:
        lm = load_model(folder, device=Target(device, GPU.capability), quant=scheme, kernel=named,
                        check_kernels=False, calibration="none")
    assert lm.device.type == "cuda" and lm.dtype == (torch.float16 if scheme == "fp16" else torch.bfloat16)
    assert_on_device(model_tensors_of(lm.model), device)
    assert_cuda_kernels(lm.model, scheme, lm.kernels, named)
    assert lm.kernels["attention-cuda"] == lm.config.n_layers  # what --verbose reports
    with fake:
        got = run_runtime(lm.model, lm.tokenizer)
    check_audit(got, lm.config.n_layers)
    # the CPU path's forwards, for real, in the GPU's activation dtype (the CPU's own default is fp32)
    cpu = load_model(folder, device="cpu", quant=scheme, dtype="fp16" if scheme == "fp16" else "bf16",
                     check_kernels=False, calibration="none")
    want = run_runtime(cpu.model)
    for key in FORWARDS:
        assert got[key] == want[key], (key, got[key], want[key])
    assert [p[:2] for p in got["pool"]] == [p[:2] for p in want["pool"]] and got["pool"][0][2] == str(device)


# --------------------------------------------------------------------------- real shapes, fake weights
#: SmolLM2-135M-Instruct's config.json (HuggingFaceTB), the default model: widths 576 and 1536.
SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
#: Llama-2-7B's shapes (no GQA, not tied).
LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def fake_checkpoint(config: ModelConfig, plan: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint of ``config`` in ``plan``'s schemes holds (canonical quantized
    tensors, float ones in fp32), as fake tensors of the right shapes and dtypes: no storage at all."""
    model = empty_model(config)
    swap_linears(model, plan)
    for name, t in model.state_dict().items():
        yield name, torch.empty(t.shape, dtype=t.dtype)


def build_on_fake_gpu(config: ModelConfig, scheme: str, target: Target = GPU, kernel: str | None = None):
    """``config``'s model in ``scheme`` (on the kernel named, if one is), built on meta, fused, and
    filled from :func:`fake_checkpoint` on the fake GPU as ``load_model`` fills a real one (call
    inside the fake mode)."""
    model = empty_model(config)
    plan = make_plan(model, parse_scheme(scheme)) if scheme in CUDA_KERNEL else {}
    swap_linears(model, plan)
    fuse_projections(model)
    act = torch.float16 if scheme == "fp16" else torch.bfloat16
    return load_weights(model, fake_checkpoint(config, plan), target, act, "fake weights", kernel, check=False)


@pytest.mark.parametrize("case", [scheme_param(s) for s in SCHEMES] + ["int4+tinygemm", "int8+int8pack"])
def test_smollm2_shapes_run_their_cuda_path_on_a_fake_gpu(case, fake):
    """The default model's real widths (576 inputs: not a multiple of 128) on the CUDA path; tinygemm,
    named, packs them by 4 k-tiles, and ``_weight_int8pack_mm``, named, keeps its argument checks."""
    config = ModelConfig.from_hf(SMOLLM2)
    scheme, named, _ = parse_case(case)
    with fake:
        model = build_on_fake_gpu(config, scheme, kernel=named)
        assert_on_device(model_tensors_of(model))
        assert_cuda_kernels(model, scheme, named=named)
        got = run_runtime(model)  # the loops run the same forwards: tested on the tiny models
    check_audit(got, config.n_layers)
    act = model.dtype
    assert [got[key] for key in FORWARDS] == [((1, 12, 49152), act), ((1, 1, 49152), act), ((1, 2, 49152), act),
                                              ((1, 2, 49152), act)]
    assert got["pool"][0] == ((8, 3, 16, 64), act, "cuda:0")  # 128 tokens' budget: 8 blocks of 16


def test_a_7b_llama_takes_the_bytes_the_arithmetic_says(fake):
    """Llama-2-7B on the fake GPU in fp16 and int4 (group 32): the weights' bytes, counted from the
    fake tensors, against the parameter count; the KV pool of one 4096-token sequence (what ``run``
    allocates: :func:`runtime.engine.sequence_engine`) and a batch engine's pool of a 1 GiB budget
    against runtime.kv_pool.cache_bytes. No real memory: meta, then fake tensors."""
    config = ModelConfig.from_hf(LLAMA2_7B)
    assert config.num_parameters() == 6_738_415_616
    block = config.n_layers * (config.dim * (config.q_dim + 2 * config.kv_dim) + config.q_dim * config.dim
                               + 3 * config.dim * config.intermediate_size)
    rest = config.num_parameters() - block  # embedding, head and norms, 16-bit in both schemes
    for scheme, want in [("fp16", 2 * config.num_parameters()),
                         # int4: a code is half a byte; an fp16 scale and offset per group of 32
                         ("int4", block // 2 + block // 32 * 2 * 2 + 2 * rest)]:
        with fake:
            model = build_on_fake_gpu(config, scheme)
            assert_on_device(model_tensors_of(model))
            assert_cuda_kernels(model, scheme)
            audit, tokens = Audit(), torch.tensor([[1, 2, 3]], device="cuda")
            with audit.during("whole"), torch.inference_mode():
                logits = model(tokens, last_only=True)
            assert set(audit.kinds("whole")) <= {"op", "host", "h2d-async"} and logits.shape == (1, 1, 32000)
        weights = sum(t.numel() * t.element_size() for _, t in model_tensors_of(model))
        assert weights == want, (scheme, weights, want)
    assert (2 * config.num_parameters(), want) == (13_476_831_232, 4_047_503_360 + 2 * rest)
    # The memory plan (what `run` checks before loading): int4 with a 4096-token context (its cache
    # in bf16, the whole prompt prefilled in one chunk) fits an 8 GB card's free memory once its CUDA
    # context holds its share (taken as 7.5 GiB free).
    plan7b = plan_for(Footprint(config, "int4", want, torch.bfloat16, torch.device("cuda")), 4096,
                      available=(int(7.5 * 2**30), "an 8 GB card"))
    print(f"7B int4, ctx 4096: {plan7b.total / 1e9:.2f} GB planned (weights {plan7b.weights / 1e9:.2f}, "
          f"KV {plan7b.kv_cache / 1e9:.2f}, activations {plan7b.activations / 1e9:.2f})")
    assert plan7b.fits and plan7b.kv_cache >= cache_bytes(config, 4096, torch.bfloat16)  # (and the RoPE tables)

    def pool_tensors(pool: KVPool) -> list[torch.Tensor]:
        return list({id(t): t for t in pool.k + pool.v}.values())  # layers sharing a slot's tensor: once

    with fake:
        one = sequence_engine(model, 4096)
        plan = plan_pool(config, 1 << 30, model.dtype)
        engine = BatchEngine(model, kv_budget_bytes=1 << 30)
    kv = sum(t.numel() * t.element_size() for t in pool_tensors(one.pool))  # k and v of every layer
    assert one.plan.n_blocks * one.plan.block_size == 4096 and kv == cache_bytes(config, 4096, torch.bfloat16) == 2 << 30
    pool = sum(t.numel() * t.element_size() for t in pool_tensors(engine.pool))
    assert pool == plan.bytes == plan.n_blocks * cache_bytes(config, plan.block_size, torch.bfloat16) <= 1 << 30
    assert all(t.device.type == "cuda" for t in pool_tensors(one.pool) + pool_tensors(engine.pool))


# --------------------------------------------------------------------------- the dry run's own checks
def test_the_device_decision_is_given_not_asked(fake, monkeypatch, wide_folders):
    """Kernels are chosen for the Target given: torch.cuda is never asked (it would fail here), an
    sm75 card falls back to the reference with the reason, and ``--device cuda`` typed by a user on a
    machine without a GPU is still the one-line error."""
    from localllm.errors import LocalLLMError

    def no_gpu(*args, **kwargs):
        raise AssertionError("torch.cuda asked about a GPU")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    kernels.WARNED.clear()
    with fake, pytest.warns(UserWarning, match="compute capability 8.0 or newer .this one has 7.5"):
        turing = build_on_fake_gpu(ModelConfig.from_hf({**SMOLLM2, "num_hidden_layers": 1}), "int4",
                                   Target(torch.device("cuda"), (7, 5)))
    assert {m.kernel.name for m in turing.modules() if isinstance(m, QuantLinear)} == {"reference"}
    assert kernels.why_not_fast(turing.layers[0].mlp.down, Target(torch.device("cuda"), (7, 5)), torch.bfloat16) == [
        "int4-triton-cuda needs a GPU of compute capability 8.0 or newer for bfloat16 activations (this one has 7.5)",
        "int4-tinygemm-cuda needs a GPU of compute capability 8.0 or newer (this one has 7.5)"]
    if not torch.cuda.is_available():
        with pytest.raises(LocalLLMError, match="no CUDA GPU is visible"):
            load_model(str(wide_folders("llama")), device="cuda")


def test_the_audit_sees_syncs_transfers_and_host_tensors(fake):
    with fake:
        x = torch.ones(4, 8, device="cuda")
        audit = Audit()
        with audit.during("f"):
            x + torch.tensor([1.0] * 8, device="cuda")  # a blocking upload
            x + torch.tensor([1.0] * 8).to("cuda", non_blocking=True)
            x.cpu()
            x[torch.tensor([0, 2])]  # indices left on the host: copied up inside the op
            torch.arange(4.0) * 2  # host work alone
            with pytest.raises(fake_tensor.DataDependentOutputException):
                x.sum().item()
    assert {k: n for k, n in audit.kinds("f").items() if k != "op"} == {
        "h2d": 1, "h2d-async": 1, "d2h": 1, "off-device": 1, "host": 2, "read": 1}


def test_the_dry_run_catches_a_tinygemm_layout_the_cuda_kernel_refuses(fake, monkeypatch):
    """Scales and zeros laid out (out, groups, 2) instead of (groups, out, 2): the meta kernel takes
    them (it checks no scales), the CUDA kernel's TORCH_CHECK does not; the dry run says so."""
    config = ModelConfig.from_hf({**LLAMA2_7B, "num_hidden_layers": 1, "hidden_size": 256,
                                  "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4})
    real = kernels.Int4TinygemmCPU._scales_and_zeros
    monkeypatch.setattr(kernels.Int4TinygemmCPU, "_scales_and_zeros",
                        staticmethod(lambda layer: real(layer).transpose(0, 1).contiguous()))
    with fake:
        model = build_on_fake_gpu(config, "int4", kernel="int4-tinygemm-cuda")
        tokens = torch.tensor([[1, 2, 3]], device="cuda")
        model(tokens, last_only=True)  # the meta kernels alone: no complaint
        with pytest.raises(AssertionError, match="int4mm: scales"), Audit().during("whole"):
            model(tokens, last_only=True)


# --------------------------------------------------------------------------- MoE experts in CPU RAM
@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A tiny Qwen3-MoE's HF folder (3 layers, the middle one dense: tests/test_moe.py's)."""
    from tests.conftest import hf_folders
    from tests.test_moe import qwen3_moe_model

    return hf_folders({"qwen3_moe": qwen3_moe_model}, "dryrun-moe", tmp_path_factory)("qwen3_moe")[1]


def _experts_devices(model) -> dict[int, set[str]]:
    """Each sparse layer's experts' tensors' devices."""
    return {i: {str(t.device) for t in [*layer.mlp.experts.parameters(), *layer.mlp.experts.buffers()]}
            for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts")}


def _gpu_parts(model) -> list[tuple[str, torch.Tensor]]:
    """Every tensor but the experts': embeddings, attention, norms, routers, head."""
    return [(n, t) for n, t in model_tensors_of(model) if ".mlp.experts." not in n]


@pytest.mark.parametrize("choice", ["cpu_moe", "n_cpu_moe", "automatic"])
def test_moe_experts_placed_in_cpu_ram_cross_to_the_host_and_back(choice, moe_folder, fake, host_checkpoints,
                                                                 monkeypatch):
    """A tiny Qwen3-MoE (sparse layers 0 and 2) in int4 on the fake GPU with its experts placed by
    ``--cpu-moe``, ``--n-cpu-moe 1`` or the plan (the GPU's memory forced to leave room for all but
    layer 0's experts): the experts placed in CPU RAM are there, on the native CPU expert kernel, and
    everything else is on the GPU. With every expert in CPU RAM a forward sends each sparse layer's
    rows, routed ids and weights to the host (3 copies down), runs ``localllm::moe_ffn`` there on host
    tensors alone, and sends the sum back without blocking: no other read, no blocking upload."""
    from localllm.loaders.memory_plan import AVAILABLE_ENV, footprint, plan_for
    from localllm.loaders.spec import LoadSpec

    ckpt = load_module.open_checkpoint(str(moe_folder))
    fp = footprint(ckpt, LoadSpec(str(moe_folder), device=GPU, quant="int4"))
    assert fp.expert_bytes[1] == 0 and fp.expert_bytes[0] == fp.expert_bytes[2] > 0
    whole = plan_for(fp, min(fp.config.max_seq_len, 4096), available=(10**12, "t"), host_available=(10**12, "t"))
    # the GPU short of half a layer's experts: the plan keeps layer 0's in CPU RAM
    monkeypatch.setenv(AVAILABLE_ENV, str(whole.total - fp.expert_bytes[0] // 2))
    options = {"cpu_moe": {"cpu_moe": True}, "n_cpu_moe": {"n_cpu_moe": 1}, "automatic": {}}[choice]
    with fake:
        lm = load_model(str(moe_folder), device=GPU, quant="int4", check_kernels=False, **options)
        model = lm.model
        assert_on_device(_gpu_parts(model))
        host = {0, 2} if choice == "cpu_moe" else {0}
        assert _experts_devices(model) == {i: {"cpu"} if i in host else {"cuda:0"} for i in (0, 2)}
        assert lm.placement is not None and lm.placement.host_layers == tuple(sorted(host))
        assert lm.placement.chosen_by == {"cpu_moe": "--cpu-moe", "n_cpu_moe": "--n-cpu-moe 1",
                                          "automatic": "automatic"}[choice]
        assert lm.kernels["experts-moe-blocks-cpu on cpu"] == len(host)
        for i in host:
            assert model.layers[i].mlp.experts.down.kernel.name == "moe-blocks-cpu"
        if choice != "cpu_moe":
            return  # the GPU's experts run the reference, whose counts are read back: not this test's
        audit, tokens = Audit(), torch.tensor([PROMPTS[0]], device="cuda")
        with audit.during("whole"), torch.inference_mode():
            logits = model(tokens)
    assert logits.shape == (1, 12, model.config.vocab_size) and logits.device.type == "cuda"
    kinds = audit.kinds("whole")
    assert set(kinds) <= {"op", "host", "h2d-async", "d2h"}, kinds
    assert kinds["d2h"] == 3 * 2  # each sparse layer: its rows, ids and weights
    host_ops = audit.of("host", "whole")
    assert host_ops.count("localllm.moe_ffn.default") == 2, host_ops
    assert len(audit.of("h2d-async", "whole")) == 2 + 1  # the sums come back (and the RoPE frequencies go up)


# --------------------------------------------------------------------------- --gpu-layers: blocks in CPU RAM
@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("gemma3", True)])
def test_gpu_layers_keep_the_first_blocks_and_their_kv_in_cpu_ram(family, tied, tiny_folder, fake, host_checkpoints,
                                                                  monkeypatch):
    """A 3-block dense Llama in int4 with ``--gpu-layers 1``: blocks 0-1 (and, untied, the embedding
    table) in CPU RAM on the CPU's kernels, their KV pool tensors there too; block 2, the norm and the
    head on the GPU. The engine's runner refuses CUDA graphs for it (eager, with the reason), and a
    step builds its metadata on both devices: one upload of the step's indices and one of the hidden
    state at the boundary, both non-blocking; nothing read back. A table tied to the head stays on the
    GPU with it, so its rows come down to the CPU blocks once (the one blocking copy). Gemma 3's pool
    of layer groups (one slot shared by the groups of both devices: a tensor on each) likewise, with
    its first 2 of 4 blocks in CPU RAM."""
    from localllm.loaders.memory_plan import AVAILABLE_ENV

    extra = {**FAMILIES["gemma3"], "num_hidden_layers": 4} if family == "gemma3" else {"num_hidden_layers": 3}
    folder = str(tiny_folder(family, **WIDE, **extra, tie_word_embeddings=tied)[1])
    monkeypatch.setenv(AVAILABLE_ENV, "1TB")  # the fake GPU's free memory (torch.cuda has none to give)
    n_cpu = 2
    gpu_layers = extra["num_hidden_layers"] - n_cpu
    with fake:
        lm = load_model(folder, device=GPU, quant="int4", check_kernels=False, calibration="none",
                        gpu_layers=gpu_layers)
    model, where = lm.model, lm.placement
    assert where is not None and where.cpu_layers == (0, 1) and where.layers_by == f"--gpu-layers {gpu_layers}"
    assert where.embed_on_host == (not tied)
    on_host = ("layers.0.", "layers.1.") + (() if tied else ("embed.",))
    assert_on_device([(n, t) for n, t in model_tensors_of(model) if not n.startswith(on_host)])
    host = [(n, str(t.device)) for n, t in model_tensors_of(model) if n.startswith(on_host)]
    assert host and all(d == "cpu" for _, d in host), host
    for i, layer in enumerate(model.layers):  # each block's layers on its own device's kernel
        want = "int4-triton-cuda" if i >= n_cpu else "cpu"
        assert all(want in m.kernel.name for m in layer.modules() if isinstance(m, QuantLinear)), (i, want)
    assert (lm.kernels["attention-cpu"], lm.kernels["attention-cuda"]) == (n_cpu, gpu_layers)  # what --verbose says
    devices = ["cpu"] * n_cpu + ["cuda:0"] * gpu_layers
    assert model.split and [str(d) for d in model.layer_devices()] == devices
    with fake:
        engine = BatchEngine(model, kv_budget_bytes=cache_bytes(model.config, 128, torch.bfloat16), max_running=4)
        assert [str(t.device) for t in engine.pool.k + engine.pool.v] == devices * 2
        assert engine.runner.graphs is None and "--gpu-layers" in engine.runner.eager_reason
        audit = Audit()
        for phase, chunks in paged_steps(len(engine.plan.windows)).items():
            with audit.during(phase):
                logits = engine.runner.forward(chunks)
            assert logits.shape == (len([c for c in chunks if c.samples]), model.config.vocab_size), phase
            assert logits.device.type == "cuda" and logits.dtype == torch.bfloat16
            kinds = audit.kinds(phase)
            # the step's indices go up once, the CPU blocks' copy built on the host; the hidden state up
            # once at the boundary; a tied table's rows down once
            assert kinds["h2d-async"] == 2 and kinds["h2d"] == 0 and kinds["read"] == 0, (phase, kinds)
            assert kinds["d2h"] == (1 if tied else 0) and kinds["off-device"] == 0, (phase, kinds)
            host_ops = audit.of("host", phase)
            # the CPU blocks' attention: the CPU's paged decode kernel for single queries (one call a block),
            # SDPA for bf16 prefill chunks (the chunk kernel takes fp32 queries)
            decode = host_ops.count("localllm.paged_decode_attention.default")
            sdpa = host_ops.count("aten.scaled_dot_product_attention.default")
            assert (decode, sdpa) == ((0, 2 * n_cpu) if phase == "prefill" else (n_cpu, 0)), (phase, decode, sdpa)
            assert audit.of("op", phase).count(SPAN_OP) == gpu_layers  # the GPU blocks' span kernel
        # the token loop: a greedy request to its end
        handle = engine.submit(PROMPTS[0], SamplingParams(temperature=0), max_tokens=2)
        loops = Audit(token=3)
        while True:
            with loops.during("loop"):
                if not engine.step():
                    break
    assert handle.stats.finish_reason == "length" and handle.stats.generated_tokens == 2
    assert loops.kinds("loop")["h2d"] == 0


def test_gpu_layers_with_moe_experts_keep_a_cpu_blocks_experts_in_ram(moe_folder, fake, host_checkpoints, monkeypatch):
    """``--gpu-layers 1`` on the tiny Qwen3-MoE (sparse layers 0 and 2): blocks 0-1 whole in CPU RAM,
    layer 0's experts on the CPU's expert kernel with them; block 2 with its experts on the GPU (the
    plan has room for them), as are its attention, the norm and the head."""
    from localllm.loaders.memory_plan import AVAILABLE_ENV

    monkeypatch.setenv(AVAILABLE_ENV, "1TB")
    with fake:
        lm = load_model(str(moe_folder), device=GPU, quant="int4", check_kernels=False, gpu_layers=1)
    model, where = lm.model, lm.placement
    assert where.cpu_layers == (0, 1) and where.host_layers == (0,) and where.n_cpu_moe == 0
    assert _experts_devices(model) == {0: {"cpu"}, 2: {"cuda:0"}}
    assert lm.kernels["experts-moe-blocks-cpu on cpu"] == 1
    on_host = ("layers.0.", "layers.1.", "embed.")
    assert_on_device([(n, t) for n, t in model_tensors_of(model) if not n.startswith(on_host)])
    assert {str(t.device) for n, t in model_tensors_of(model) if n.startswith(on_host)} == {"cpu"}
    assert [str(d) for d in model.layer_devices()] == ["cpu", "cpu", "cuda:0"]


def test_a_served_model_is_placed_as_serve_was_told(moe_folder, fake, host_checkpoints, monkeypatch):
    """``serve --cpu-moe --gpu-layers 2``: the spec the server loads every model by
    (``ServerConfig.load_spec``, its device made the fake GPU) keeps block 0 whole in CPU RAM and block
    2's experts there too, while blocks 1-2's attention, the norm and the head are on the GPU."""
    from dataclasses import replace

    from localllm.loaders.memory_plan import AVAILABLE_ENV
    from localllm.server.config import ServerConfig

    monkeypatch.setenv(AVAILABLE_ENV, "1TB")  # room for everything: the flags alone move parts to CPU RAM
    spec = ServerConfig(quant="int4", cpu_moe=True, gpu_layers=2).load_spec(str(moe_folder))
    with fake:
        lm = load_model(replace(spec, device=GPU), check_kernels=False)
    where = lm.placement
    assert (where.chosen_by, where.layers_by) == ("--cpu-moe", "--gpu-layers 2")
    assert where.cpu_layers == (0,) and where.host_layers == (0, 2)
    assert _experts_devices(lm.model) == {0: {"cpu"}, 2: {"cpu"}}
    assert [str(d) for d in lm.model.layer_devices()] == ["cpu", "cuda:0", "cuda:0"]
    assert_on_device([(n, t) for n, t in _gpu_parts(lm.model) if not n.startswith(("layers.0.", "embed."))])

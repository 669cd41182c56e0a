"""The model's side of a step: the scheduler's chunks to logits.

A :class:`ModelRunner` holds what every forward of an engine shares (the model, the paged KV pool,
RoPE tables, the attention kernels of the device) and runs each step through the first path that
takes it:

1. the compiled decode step (:mod:`runtime.compiled_step`), for steps in which every sequence runs
   single queries, where its packages are built;
2. CUDA graphs captured per batch-size bucket (:mod:`runtime.cuda_graphs`), the same steps on a GPU;
3. the eager forward, which takes every step (prefill chunks too).

A model whose first blocks live in CPU RAM (``--gpu-layers N``: :mod:`loaders.placement`) runs eagerly
(neither a compiled step nor CUDA graphs take a model on two devices: :attr:`ModelRunner.eager_reason`):
each step is built twice from the same chunks, once on the host with the CPU's attention kernels and
RoPE tables, which the CPU blocks read, and once uploaded (one non-blocking copy) for the GPU's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localllm.runtime.compiled_step import CompiledDecode, find_step, wanted_batch
from localllm.runtime.cuda_graphs import GraphedDecode
from localllm.runtime.kv_pool import KVPool
from localllm.runtime.model import Transformer, cache_rope_tables
from localllm.runtime.paged import PagedChunkAttention, PagedDecodeAttention, PagedSpanAttention, PagedStep
from localllm.runtime.scheduler import Chunk
from localllm.runtime.speculate import MAX_DRAFT


class ModelRunner:
    """Runs steps of ``model`` over ``pool`` for sequences of up to ``max_seq_len`` positions.

    ``attention``: "auto" runs single queries with localllm's paged CPU kernel on the CPU (and prefill
    chunks with its chunk kernel), and every span with the Triton paged kernel on CUDA; "sdpa" gathers
    blocks and runs SDPA (the reference). ``cuda_graphs``: on a GPU with the paged kernel, replay
    decode-only steps from graphs captured for up to ``max_running`` sequences.
    """

    def __init__(self, model: Transformer, pool: KVPool, max_seq_len: int, *, attention: str = "auto",
                 cuda_graphs: bool = True, max_running: int = 32) -> None:
        if attention not in ("auto", "sdpa"):
            raise ValueError(f"attention must be 'auto' or 'sdpa', not {attention!r}")
        self.model = model
        self.pool = pool
        device = model.device
        cos, sin = cache_rope_tables(model.config, max_seq_len, device)
        self.cos, self.sin = cos.to(model.dtype), sin.to(model.dtype)  # (max_seq_len, rot), 2 * rot with local ones
        self.kernel: PagedDecodeAttention | PagedSpanAttention | None = None
        self.chunk: PagedChunkAttention | None = None  # prefill chunks' attention beside a decode kernel
        if attention == "auto" and device.type == "cpu":
            from localllm.runtime import cpu_attention

            self.kernel = cpu_attention.paged_kernel()
            self.chunk = cpu_attention.chunk_kernel(model.config.head_dim)
        elif attention == "auto" and device.type == "cuda":
            from localllm.runtime import cuda_attention

            self.kernel = cuda_attention.span_kernel()
        #: A split model's host side (:meth:`forward`): RoPE tables and the CPU's attention kernels.
        self.host: tuple[torch.Tensor, torch.Tensor, PagedDecodeAttention | PagedSpanAttention | None,
                         PagedChunkAttention | None] | None = None
        #: Why every step runs eagerly (None: the paths above may take them).
        self.eager_reason: str | None = None
        if model.split:
            host_cos, host_sin = self.cos.cpu(), self.sin.cpu()  # once: the tables' copy the CPU blocks read
            host_kernel = host_chunk = None
            if attention == "auto":
                from localllm.runtime import cpu_attention

                host_kernel = cpu_attention.paged_kernel()
                host_chunk = cpu_attention.chunk_kernel(model.config.head_dim)
            self.host = (host_cos, host_sin, host_kernel, host_chunk)
            self.eager_reason = ("steps run eagerly: the first blocks live in CPU RAM (--gpu-layers), and neither "
                                 "CUDA graphs nor a compiled step take a model on two devices")
        self.compiled: CompiledDecode | None = None
        #: Decode-only steps replayed from CUDA graphs (on a real GPU with the paged kernel).
        self.graphs: GraphedDecode | None = None
        if (cuda_graphs and self.kernel is not None and device.type == "cuda" and torch.cuda.is_available()
                and self.host is None
                and all(layer.attn.takes_kernels for layer in model.layers)
                and not model.config.is_moe):  # the experts' routing reads back each expert's rows
            self.graphs = GraphedDecode(model, pool, self.kernel, self.cos, self.sin, max_running)
        #: The last :meth:`load_compiled` found a package this engine wants not built (``localllm
        #: compile``), never tried or due for a retry after a failed build.
        self.needs_build = False
        self.compile_s = 0.0  # building or loading the compiled step's packages
        #: Why (some) steps run eagerly although compiling was asked for, and after a failed build when
        #: it is tried again (None: they do not, or it was not asked for).
        self.compile_note: str | None = None

    def load_compiled(self, build: bool, max_running: int, speculate: bool) -> None:
        """Find the compiled decode step's packages (build the missing ones with ``build``): those of
        :func:`runtime.compiled_step.wanted_batch` rows; packages built for more rows serve too, up
        to a verify step's with speculation."""
        if self.host is not None:
            return  # a split model runs eagerly (eager_reason)
        rows = max_running * (1 + MAX_DRAFT) if speculate else max_running
        found = find_step(self.model, self.pool, self.kernel, max_running, build, load_batch=rows,  # type: ignore[arg-type]
                          want_batch=wanted_batch(max_running, speculate))
        self.compiled, self.compile_s = found.step, found.seconds
        self.needs_build, self.compile_note = found.needs_build, found.note

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """One forward over ``chunks`` -> the logits (S_out, vocab) of each sampling chunk's rows, in order."""
        step, ids = PagedStep.build(self.pool, chunks, self.cos, self.sin, self.kernel, self.chunk)
        if self.host is not None:  # the same step on the host, for the CPU blocks: built there, no transfer
            host, host_ids = PagedStep.build(self.pool, chunks, *self.host)
            step.host, host.ids = host, host_ids
            return self.model(ids, step)[0]
        if self.compiled is not None and self.compiled.takes(step):
            return self.compiled(ids, step)
        if self.graphs is not None and self.graphs.takes(step):
            return self.graphs(ids, step)
        return self.model(ids, step)[0]

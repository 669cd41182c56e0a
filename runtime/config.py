"""ModelConfig: the shape of a Llama-family transformer, from an HF ``config.json`` or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import LocalLLMError
from localllm.runtime.config_checks import (INT_RANGES, MAX_TOKEN_ID, FieldReader, check_fields, check_float, check_int,
                                             check_moe, damaged)

#: HF ``model_type`` / GGUF ``general.architecture`` values this runtime runs. They share one
#: block: RMSNorm, RoPE, grouped-query attention, a gated MLP; they differ only in config fields
#: (Qwen3 and Gemma 3 add per-head q/k norms, Gemma 3 four norms per block, GeGLU, local layers;
#: Phi-3 partial rotary and longrope).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe", "qwen2_moe", "mixtral",
                           "gpt_oss", "olmoe")

#: The Mixture-of-Experts families among them: their sparse layers route each token to
#: ``n_active`` of ``n_experts`` gated MLPs (:mod:`runtime.moe`); Qwen2-MoE adds a shared expert;
#: gpt-oss biases its router and experts, clamps its SwiGLU and adds attention sinks; OLMoE norms
#: its whole q and k projections (:attr:`ModelConfig.qk_norm_full`).
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "olmoe")

#: Expert activations besides a dense MLP's: gpt-oss's clamped SwiGLU (:attr:`ModelConfig.swiglu_limit`).
CLAMPED_SWIGLU = "swiglu_clamped"

#: llama.cpp's ``general.architecture`` for the MoE families (its Mixtral is ``llama`` with experts).
_GGUF_ARCHS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss"}

#: gpt-oss's clamped SwiGLU as llama.cpp runs every gpt-oss GGUF: constants of its graph
#: (``LLM_FFN_SWIGLU_OAI_MOE``), no metadata key, the released models' ``swiglu_limit`` and alpha.
GGUF_SWIGLU_LIMIT, GGUF_SWIGLU_ALPHA = 7.0, 1.702

#: Other spellings of the same architectures: HF's text-only Gemma 3 ``model_type``.
_ALIASES = {"gemma3_text": "gemma3"}

#: Layer kinds of :attr:`ModelConfig.layer_types`.
SLIDING, FULL = "sliding", "full"

#: Rope scalings :func:`runtime.model.rope_inv_freq` applies.
ROPE_SCALINGS = ("llama3", "linear", "longrope", "yarn")


#: ``ModelConfig`` fields -> the ``config.json`` keys they are read from (for messages).
HF_KEYS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "intermediate_size": "intermediate_size", "max_seq_len": "max_position_embeddings",
           "sliding_window": "sliding_window", "norm_eps": "rms_norm_eps", "n_experts": "num_experts",
           "n_active": "num_experts_per_tok", "expert_size": "moe_intermediate_size",
           "shared_expert_size": "shared_expert_intermediate_size"}
#: ``ModelConfig`` fields -> the GGUF metadata keys they are read from, after ``{arch}.``.
GGUF_KEYS = {"vocab_size": "vocab_size", "dim": "embedding_length", "n_layers": "block_count",
             "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
             "head_dim": "attention.key_length", "intermediate_size": "feed_forward_length",
             "max_seq_len": "context_length", "sliding_window": "attention.sliding_window",
             "norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
             "n_experts": "expert_count", "n_active": "expert_used_count", "expert_size": "expert_feed_forward_length",
             "shared_expert_size": "expert_shared_feed_forward_length"}


def hf_keys(hf: dict[str, Any]) -> dict[str, str]:
    """Each field's key in this ``config.json`` (a derived head size says how it is derived)."""
    inner = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    keys = dict(HF_KEYS)
    if inner.get("head_dim") is None:
        keys["head_dim"] = "hidden_size / num_attention_heads"
    if inner.get("model_type") == "mixtral" or "num_experts" not in inner:
        keys["n_experts"] = "num_local_experts"
    if inner.get("model_type") in ("mixtral", "gpt_oss", "olmoe"):
        keys["expert_size"] = "intermediate_size"
    return keys


def gguf_keys(meta: dict[str, Any]) -> dict[str, str]:
    """Each field's key in this GGUF's metadata (a derived size says where it comes from)."""
    arch = meta.get("general.architecture", "")
    keys = {field: f"{arch}.{key}" for field, key in GGUF_KEYS.items()}
    if meta.get(keys["head_dim"]) is None:
        keys["head_dim"] = f"{arch}.embedding_length / {arch}.attention.head_count"
    if meta.get(keys["vocab_size"]) is None:
        keys["vocab_size"] = "the length of tokenizer.ggml.tokens"
    if arch == "llama" or (arch == "olmoe" and meta.get(keys["expert_size"]) is None):  # Mixtral's, OLMoE's experts
        keys["expert_size"] = f"{arch}.feed_forward_length"
    return keys


def _unsupported(what: str) -> LocalLLMError:
    return LocalLLMError(f"unsupported architecture {what}",
                         f"localllm runs {', '.join(SUPPORTED_ARCHITECTURES)} models")


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
    #: Local attention window (tokens), or None for full attention: every layer's (Mistral, Phi-3), or
    #: with :attr:`layer_types` the sliding layers' only (Gemma 3).
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    #: Per layer, "sliding" or "full" (Gemma 3's pattern); None: every layer alike.
    layer_types: list[str] | None = None
    #: RoPE base of the sliding layers (Gemma 3's local base); None: :attr:`rope_theta`. Rope scaling
    #: applies to the full layers only when this is set.
    rope_local_theta: float | None = None
    #: Fraction of each head's dims that RoPE rotates (Phi-3.5/Phi-4-mini); the rest pass through.
    partial_rotary: float = 1.0
    #: RMSNorm on each query and key head (over head_dim) before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    #: With :attr:`qk_norm`: one RMSNorm over the whole projected q (n_heads x head_dim) and another over
    #: k (n_kv_heads x head_dim), before the split into heads (OLMoE), not one per head.
    qk_norm_full: bool = False
    #: OLMoE's ``clip_qkv``: q, k and v (after the q/k norms) clamped to +-this; None: not clamped.
    clip_qkv: float | None = None
    #: Gemma's RMSNorm: ``x * (1 + w)`` in fp32, then cast (0 = Llama's ``w * x``).
    norm_offset: float = 0.0
    #: Gemma 3's four norms per block: after attention and after the MLP too.
    post_norms: bool = False
    #: Gate activation of the MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated GELU).
    mlp_act: str = "silu"
    #: Embeddings multiplied by this (Gemma: sqrt(dim), rounded to the activation dtype); None: not.
    embed_scale: float | None = None
    #: Attention's score scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attn_scale: float | None = None
    #: Gemma 2 style soft-capping ``cap * tanh(x / cap)`` of attention scores / final logits, or None.
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: Mixture of Experts (None on a dense model): experts a sparse layer holds, and how many each
    #: token is routed to.
    n_experts: int | None = None
    n_active: int | None = None
    #: The intermediate size of each expert's gated MLP (HF ``moe_intermediate_size``).
    expert_size: int | None = None
    #: Qwen2-MoE's shared expert: its intermediate size (None: no shared expert), gated by a sigmoid.
    shared_expert_size: int | None = None
    #: Whether the top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen by config).
    norm_topk_prob: bool = False
    #: The sparse layers' indices (the others have a dense MLP of :attr:`intermediate_size`); None:
    #: every layer, on a MoE model.
    moe_layers: list[int] | None = None
    #: gpt-oss: a bias on the attention output projection (its ``attention_bias`` covers o_proj too).
    o_bias: bool = False
    #: gpt-oss: a learned logit per query head that joins each softmax's denominator (then dropped).
    attn_sinks: bool = False
    #: gpt-oss: the router's linear has a bias, and the routing weights are the softmax over the top-k
    #: logits (not the top-k of a softmax over all).
    router_bias: bool = False
    topk_softmax: bool = False
    #: gpt-oss: biases on the experts' gate/up and down projections.
    expert_bias: bool = False
    #: gpt-oss's clamped SwiGLU (:data:`CLAMPED_SWIGLU`): gate clamped above, up both sides at this limit,
    #: ``(up + 1) * gate * sigmoid(alpha * gate)``.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        self.arch = _ALIASES.get(self.arch, self.arch)
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(f"'{self.arch}'")
        check_fields(self)  # before any size is used: a config from a dict or by hand is checked here
        types = self.layer_types
        if types is not None:
            if not isinstance(types, list) or not all(t in (SLIDING, FULL) for t in types):
                raise damaged("config", "gives layer types that are not a list of 'sliding' and 'full'")
            if len(types) != self.n_layers:
                raise damaged("config", f"gives {len(types)} layer types for {self.n_layers} layers")
        if self.mlp_act == CLAMPED_SWIGLU and (self.swiglu_limit is None or self.n_experts is None
                                               or self.moe_layers is not None):
            raise damaged("config", "gives a clamped SwiGLU without its limit, or dense layers beside it")
        elif self.mlp_act not in ("silu", "gelu_tanh", CLAMPED_SWIGLU):
            raise LocalLLMError(f"unsupported MLP activation '{self.mlp_act}'",
                                "localllm runs SwiGLU (silu) and GeGLU (gelu_pytorch_tanh) MLPs")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = check_int(self.dim // self.n_heads, "head size (dim / heads)", *INT_RANGES["head_dim"],
                                      "config")
        if self.n_heads % self.n_kv_heads:  # type: ignore[operator]
            raise damaged("config", f"gives {self.n_heads} attention heads, not a multiple of its "
                                    f"{self.n_kv_heads} kv heads")
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
        check_moe(self)
        s = self.rope_scaling
        if s is not None and s.get("rope_type") == "longrope":
            n = self.rotary_dim // 2
            if any(len(s.get(f) or []) != n for f in ("short_factor", "long_factor")):
                raise LocalLLMError(f"bad config: longrope scaling needs short_factor and long_factor of {n} "
                                    f"values each (rotary dims {self.rotary_dim})", "the model's config is damaged")

    # Derived sizes -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` routes to experts (else it has a dense MLP)."""
        return self.n_experts is not None and (self.moe_layers is None or layer in self.moe_layers)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (tokens; None: it sees the whole context)."""
        if self.layer_types is not None and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (even)."""
        return int(self.head_dim * self.partial_rotary) // 2 * 2  # type: ignore[operator]

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim  # type: ignore[operator]

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim  # type: ignore[operator]

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        mlps = sum(self._mlp_parameters(i) for i in range(self.n_layers))
        per_layer = (
            self.dim * (self.q_dim + 2 * self.kv_dim)
            + self.q_dim * self.dim
            + (4 if self.post_norms else 2) * self.dim
            + ((self.q_dim + self.kv_dim if self.qk_norm_full else 2 * self.head_dim)  # type: ignore[operator]
               if self.qk_norm else 0)
            + (self.q_dim + 2 * self.kv_dim if self.attention_bias else 0)
            + (self.dim if self.o_bias else 0) + (self.n_heads if self.attn_sinks else 0)
        )
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + mlps + self.dim + head

    def _mlp_parameters(self, layer: int) -> int:
        """Parameters of ``layer``'s MLP: a dense one, or every expert, the router and a shared expert."""
        if not self.is_moe_layer(layer):
            return 3 * self.dim * self.intermediate_size
        shared = 3 * self.dim * self.shared_expert_size + self.dim if self.shared_expert_size else 0
        biases = (2 * self.expert_size + self.dim if self.expert_bias else 0) + (1 if self.router_bias else 0)
        return self.n_experts * (3 * self.dim * self.expert_size + self.dim + biases) + shared  # type: ignore[operator]

    def active_parameters(self) -> int:
        """Parameters a token works with: a MoE layer's routed experts only (all, on a dense model)."""
        total = self.num_parameters()
        if not self.is_moe:
            return total
        idle = (self.n_experts - self.n_active) * 3 * self.dim * self.expert_size  # type: ignore[operator]
        return total - idle * sum(self.is_moe_layer(i) for i in range(self.n_layers))

    # (De)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """From an HF ``config.json`` dict (transformers 4.x and 5.x keys). A multimodal Gemma 3 config
        nests its language model under ``text_config``: that part is read (the vision tower is not run)."""
        outer = hf
        if isinstance(hf.get("text_config"), dict) and hf.get("model_type") == "gemma3":
            hf = {"model_type": "gemma3_text", **hf["text_config"]}
        arch = _ALIASES.get(hf.get("model_type", ""), hf.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            archs = outer.get("architectures") or [arch or "unknown"]
            raise _unsupported(f"'{archs[0]}' (model_type '{hf.get('model_type', '')}')")
        read = FieldReader(hf, "config.json")
        dim = read.int("hidden_size", "dim")
        n_layers = read.int("num_hidden_layers", "n_layers")
        n_heads = read.int("num_attention_heads", "n_heads")
        head_dim = read.int("head_dim", "head_dim", None)
        if head_dim is None:
            head_dim = check_int(dim // n_heads, "hidden_size / num_attention_heads", *INT_RANGES["head_dim"],
                                 "config.json")
        theta, local_theta, scaling = _hf_rope(hf, arch)
        partial = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        eos: list[int] = []
        for src in (generation_config or {}, hf, outer):
            e = src.get("eos_token_id")
            for i in e if isinstance(e, list) else [e] if e is not None else []:
                i = check_int(i, "eos_token_id", 0, MAX_TOKEN_ID, "config.json")
                if i not in eos:
                    eos.append(i)
        gemma, oss = arch == "gemma3", arch == "gpt_oss"
        layer_types = _hf_layer_types(hf, n_layers, 2 if oss else 6) if gemma or oss else None
        if gemma or oss:
            # transformers' defaults where a config leaves the window out: Gemma 3's 4096, gpt-oss's 128
            sliding = read.int("sliding_window", "sliding_window",
                               (128 if oss else 4096) if "sliding_window" not in hf else None)
        elif arch == "phi3" or hf.get("use_sliding_window", arch in ("mistral", "mixtral")):
            sliding = read.int("sliding_window", "sliding_window", None, (0, INT_RANGES["sliding_window"][1])) or None
        else:
            sliding = None
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        moe = _hf_moe(read, hf, arch, n_layers) if arch in MOE_ARCHITECTURES else {}
        if oss:  # its experts and routing (runtime.moe), its attention's output bias and sinks
            act = CLAMPED_SWIGLU
            moe.update(o_bias=bool(hf.get("attention_bias", True)), attn_sinks=True, router_bias=True,
                       topk_softmax=True, expert_bias=True,
                       swiglu_limit=read.float("swiglu_limit", None, 7.0),
                       swiglu_alpha=read.float("swiglu_alpha", None, 1.702))
        return cls(
            arch=arch,
            vocab_size=read.int("vocab_size", "vocab_size"),
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=read.int("num_key_value_heads", "n_kv_heads", n_heads),
            head_dim=head_dim,
            intermediate_size=read.int("intermediate_size", "intermediate_size"),
            norm_eps=read.float("rms_norm_eps", "norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=read.int("max_position_embeddings", "max_seq_len", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", outer.get("tie_word_embeddings", gemma))),
            # Qwen2 always has q/k/v bias, Qwen2-MoE by its qkv_bias; Llama and Qwen3 configs say so
            # with attention_bias.
            # attention_bias, gpt-oss's default True as transformers' (its output projection's too).
            attention_bias=bool(hf.get("qkv_bias", True) if arch == "qwen2_moe" else
                                hf.get("attention_bias", arch in ("qwen2", "gpt_oss"))),
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id", outer.get("bos_token_id")),
            eos_token_ids=eos,
            layer_types=layer_types,
            rope_local_theta=local_theta,
            partial_rotary=partial or 1.0,
            qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
            qk_norm_full=arch == "olmoe",
            clip_qkv=read.float("clip_qkv", None, None) if arch == "olmoe" else None,
            norm_offset=1.0 if gemma else 0.0,
            post_norms=gemma,
            mlp_act={"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act, act),
            embed_scale=float(dim) ** 0.5 if gemma else None,
            attn_scale=read.float("query_pre_attn_scalar", None, 256.0) ** -0.5 if gemma else None,
            # Gemma 3 keeps attn_logit_softcapping in its config but neither transformers nor llama.cpp
            # applies it (Gemma 2 did): the model's path for it stays unused here.
            attn_softcap=None,
            final_softcap=read.float("final_logit_softcapping", "final_softcap", None) if gemma else None,
            **moe,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], *, tie_embeddings: bool,
                  rope_freq_factors: list[float] | None = None,
                  longrope_factors: tuple[list[float], list[float]] | None = None) -> "ModelConfig":
        """From GGUF metadata (see :func:`loaders.gguf_meta.read_metadata`).

        ``tie_embeddings``, ``rope_freq_factors`` and ``longrope_factors`` are tensors, not metadata: the
        first is true when the file has no ``output.weight``, the second is the ``rope_freqs.weight``
        tensor's values, the third Phi-3's ``rope_factors_short.weight`` and ``rope_factors_long.weight``.
        """
        arch = meta.get("general.architecture", "")  # the metadata's namespace; ``ours`` the family
        ours = "mixtral" if arch == "llama" and meta.get("llama.expert_count") else _GGUF_ARCHS.get(arch, arch)
        if ours not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(f"'{arch}' in the GGUF")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        read = FieldReader(meta, "GGUF metadata")
        ns = f"{arch}."
        n_layers = read.int(ns + "block_count", "n_layers")
        dim = read.int(ns + "embedding_length", "dim")
        n_heads = read.int(ns + "attention.head_count", "n_heads")
        head_dim = read.int(ns + "attention.key_length", "head_dim", None)
        if head_dim is None:
            head_dim = check_int(dim // n_heads, f"{ns}embedding_length / {ns}attention.head_count",
                                 *INT_RANGES["head_dim"], "GGUF metadata")
        vocab = read.int(ns + "vocab_size", "vocab_size", None)
        if vocab is None:
            vocab = check_int(len(meta.get("tokenizer.ggml.tokens", [])), "a vocabulary of tokenizer.ggml.tokens",
                              *INT_RANGES["vocab_size"], "GGUF metadata")
        scaling = None
        kind = key("rope.scaling.type", "none")
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": read.float(ns + "rope.scaling.factor")}
        elif kind == "yarn":
            scaling = _gguf_yarn(read, ns)
        elif kind not in ("none", "longrope") or (kind == "longrope" and longrope_factors is None):
            raise LocalLLMError(
                f"unsupported rope scaling '{kind}' in the GGUF",
                "localllm supports linear and YaRN rope scaling, llama3's frequency factors (rope_freqs) and "
                "Phi-3's longrope factors (rope_factors_short/long)",
            )
        if longrope_factors is not None:
            scaling = {"rope_type": "longrope", "short_factor": list(longrope_factors[0]),
                       "long_factor": list(longrope_factors[1]),
                       "original_max_position_embeddings": read.int(ns + "rope.scaling.original_context_length",
                                                                    None, None, INT_RANGES["max_seq_len"]),
                       "max_position_embeddings": read.int(ns + "context_length", "max_seq_len", None)}
            if key("rope.scaling.attn_factor") is not None:
                scaling["attention_factor"] = read.float(ns + "rope.scaling.attn_factor")
        gemma = arch == "gemma3"
        extra: dict[str, Any] = {}
        if gemma:
            types = _gguf_layer_types(read, ns, n_layers, 6)
            # llama.cpp's values for Gemma 3 (not in the file): local base 10000; the 27B model (62
            # layers) scales attention by (dim / heads) ** -0.5, the others by head_dim ** -0.5.
            pre_attn = dim / n_heads if n_layers == 62 else head_dim
            extra = dict(layer_types=types, rope_local_theta=10000.0, norm_offset=1.0, post_norms=True,
                         mlp_act="gelu_tanh", embed_scale=float(dim) ** 0.5, attn_scale=float(pre_attn) ** -0.5,
                         final_softcap=read.float(ns + "final_logit_softcapping", "final_softcap", None))
        rot = read.int(ns + "rope.dimension_count", None, None, (0, head_dim))
        if rot and rot != head_dim:
            extra["partial_rotary"] = rot / head_dim
        eos = [check_int(meta[k], k, 0, MAX_TOKEN_ID, "GGUF metadata")
               for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        if ours in MOE_ARCHITECTURES:
            extra.update(_gguf_moe(read, ns, ours))
        if ours == "gpt_oss":
            extra.update(_gguf_gpt_oss(read, ns, n_layers, scaling))
        return cls(
            arch=ours,
            vocab_size=vocab,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=read.int(ns + "attention.head_count_kv", "n_kv_heads", n_heads),
            head_dim=head_dim,
            intermediate_size=read.int(ns + "feed_forward_length", "intermediate_size"),
            norm_eps=read.float(ns + "attention.layer_norm_rms_epsilon", "norm_eps", 1e-5),
            rope_theta=read.float(ns + "rope.freq_base", "rope_theta", 10000.0),
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            max_seq_len=read.int(ns + "context_length", "max_seq_len", 4096),
            tie_embeddings=tie_embeddings,
            attention_bias=ours in ("qwen2", "qwen2_moe", "gpt_oss"),
            sliding_window=read.int(ns + "attention.sliding_window", None, None,
                                    (0, INT_RANGES["sliding_window"][1])) or None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos)),
            qk_norm=ours in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
            qk_norm_full=ours == "olmoe",
            **extra,
        )


def _gguf_moe(read: FieldReader, ns: str, arch: str) -> dict[str, Any]:
    """The MoE fields of a GGUF's metadata (``ns``: its ``{general.architecture}.``): experts, active
    ones, their size (Mixtral's, written as llama, is its ``feed_forward_length``), Qwen2-MoE's shared
    expert, and whether the top-k weights are renormalised (``expert_weights_norm`` where the converter
    wrote it, else as the family does: Qwen3-MoE's released models and Mixtral yes, Qwen2-MoE and
    OLMoE no).
    llama.cpp runs every layer of these families sparse."""
    # OLMoE's converter writes its experts' size as feed_forward_length (llama.cpp reads it there), a
    # newer one may add expert_feed_forward_length
    size_key = "feed_forward_length" if arch == "mixtral" or (
        arch == "olmoe" and ns + "expert_feed_forward_length" not in read.values) else "expert_feed_forward_length"
    out: dict[str, Any] = {
        "n_experts": read.int(ns + "expert_count", "n_experts"),
        "n_active": read.int(ns + "expert_used_count", "n_active"),
        "expert_size": read.int(ns + size_key, "expert_size"),
        "norm_topk_prob": bool(read.values.get(ns + "expert_weights_norm", arch not in ("qwen2_moe", "olmoe"))),
    }
    if arch == "qwen2_moe":
        out["shared_expert_size"] = read.int(ns + "expert_shared_feed_forward_length", "shared_expert_size")
    return out


def _gguf_layer_types(read: FieldReader, ns: str, n_layers: int, every: int) -> list[str]:
    """Gemma 3's and gpt-oss's per-layer kinds from ``attention.sliding_window_pattern``: one flag per
    layer (newer converters; true = sliding), or a period whose last layer is global (llama.cpp's
    default ``every``: Gemma 3's 6, gpt-oss's 2, its even layers sliding)."""
    pattern = read.values.get(ns + "attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        return [SLIDING if p else FULL for p in pattern]
    pattern = read.int(ns + "attention.sliding_window_pattern", None, every, (1, 1 << 20))
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]


def _gguf_yarn(read: FieldReader, ns: str) -> dict[str, Any]:
    """llama.cpp's YaRN keys as transformers' ``rope_scaling``: the factor, the original context, the
    ramp's betas (llama.cpp's defaults 32 and 1 where the converter wrote none), and the attention
    factor where it wrote one (transformers' ``attention_factor``, which it copies). The ramp's ends are
    rounded (``truncate``) as llama.cpp and transformers do by default; gpt-oss says otherwise
    (:func:`_gguf_gpt_oss`). An extrapolation factor other than 1 or a log multiplier is refused."""
    for name, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = read.values.get(f"{ns}rope.scaling.{name}")
        if value is not None and value != neutral:
            raise LocalLLMError(f"unsupported YaRN setting {ns}rope.scaling.{name} = {value} in the GGUF",
                                "localllm runs YaRN with its factor, original context, betas and attention factor")
    scaling: dict[str, Any] = {
        "rope_type": "yarn", "factor": read.float(ns + "rope.scaling.factor"),
        "original_max_position_embeddings": read.int(ns + "rope.scaling.original_context_length", "max_seq_len"),
        "beta_fast": read.float(ns + "rope.scaling.yarn_beta_fast", None, 32.0),
        "beta_slow": read.float(ns + "rope.scaling.yarn_beta_slow", None, 1.0)}
    attention = read.float(ns + "rope.scaling.yarn_attn_factor", None, None)
    if attention is not None:
        scaling["attention_factor"] = attention
    return scaling


def _gguf_gpt_oss(read: FieldReader, ns: str, n_layers: int, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """gpt-oss's fields that a GGUF implies rather than states (llama.cpp's ``gpt-oss`` graph):
    alternating sliding (even) and full layers, a sliding window (required, as llama.cpp reads it),
    q/k/v/o biases, sinks, the biased router's softmax over the top-k, expert biases and the clamped
    SwiGLU at llama.cpp's constants. Every layer uses the one YaRN table (no ``freq_base_swa`` other than
    the base), whose ramp is not rounded: gpt-oss's own (``truncate: false`` in its config, as OpenAI's
    reference computes it); llama.cpp's ggml rounds it, a difference of llama.cpp's, not of the file."""
    if read.values.get(ns + "attention.sliding_window") is None:
        raise damaged("GGUF metadata", f"has no {ns}attention.sliding_window (gpt-oss's sliding layers' window)")
    base, local = read.values.get(ns + "rope.freq_base"), read.values.get(ns + "rope.freq_base_swa")
    if local is not None and local != base:
        raise LocalLLMError(f"unsupported gpt-oss GGUF: its sliding layers' RoPE base {ns}rope.freq_base_swa "
                            f"= {local} differs from {ns}rope.freq_base = {base}",
                            "convert the model again with llama.cpp's convert_hf_to_gguf.py")
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling["truncate"] = False
    return dict(layer_types=_gguf_layer_types(read, ns, n_layers, 2), o_bias=True, attn_sinks=True,
                router_bias=True, topk_softmax=True, expert_bias=True, mlp_act=CLAMPED_SWIGLU,
                swiglu_limit=GGUF_SWIGLU_LIMIT, swiglu_alpha=GGUF_SWIGLU_ALPHA)


def _hf_moe(read: FieldReader, hf: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE, Qwen2-MoE or Mixtral ``config.json``: experts
    (``num_experts`` / ``num_local_experts``), active ones, their sizes, and which layers are sparse
    (``decoder_sparse_step``, ``mlp_only_layers``: as transformers places them)."""
    own = arch in ("mixtral", "gpt_oss", "olmoe")  # their experts are their intermediate_size
    key = "num_local_experts" if arch in ("mixtral", "gpt_oss") or "num_experts" not in hf else "num_experts"
    out: dict[str, Any] = {
        "n_experts": read.int(key, "n_experts"),
        "n_active": read.int("num_experts_per_tok", "n_active"),
        # Mixtral's, gpt-oss's and OLMoE's experts are their intermediate_size; Qwen's have their own.
        "expert_size": read.int("intermediate_size" if own else "moe_intermediate_size", "expert_size"),
        # Mixtral renormalises the top-k (a softmax over the chosen logits); Qwen by its config.
        "norm_topk_prob": True if arch in ("mixtral", "gpt_oss") else bool(hf.get("norm_topk_prob", False)),
    }
    if arch == "qwen2_moe":
        out["shared_expert_size"] = read.int("shared_expert_intermediate_size", "shared_expert_size")
    if not own:
        step = read.int("decoder_sparse_step", None, 1, (1, 1 << 20))
        dense = hf.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            raise damaged("config.json", "gives mlp_only_layers that is not a list")
        dense = {check_int(i, "mlp_only_layers", 0, n_layers - 1, "config.json") for i in dense}
        sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
        if len(sparse) != n_layers:
            out["moe_layers"] = sparse
    return out


def _hf_layer_types(hf: dict[str, Any], n_layers: int, every: int = 6) -> list[str]:
    """Gemma 3's and gpt-oss's per-layer kinds: ``layer_types`` when the config lists them, else every
    ``sliding_window_pattern``-th layer (default ``every``: Gemma 3's 6, gpt-oss's 2) is global."""
    named = hf.get("layer_types")
    if named:
        if not isinstance(named, list):
            raise damaged("config.json", "gives layer_types that are not a list")
        return [SLIDING if t == "sliding_attention" else FULL for t in named]
    pattern = check_int(hf.get("sliding_window_pattern") or every, "sliding_window_pattern", 1, 1 << 20, "config.json")
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]


def _hf_rope(hf: dict[str, Any], arch: str) -> tuple[float, float | None, dict[str, Any] | None]:
    """(global base, local base or None, scaling dict or None) from transformers 4.x keys
    (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) or 5.x ``rope_parameters`` (per layer
    kind for Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise damaged("config.json", f"gives {key} that is not a mapping")
    params = dict(hf.get("rope_parameters") or {})
    local: dict[str, Any] = {}
    if isinstance(params.get("full_attention"), dict):
        local = dict(params.get("sliding_attention") or {})
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or (1e6 if arch == "gemma3" else 10000.0)
    theta = check_float(theta, "rope_theta", None, "config.json")
    local_theta = None
    if arch == "gemma3":
        local_theta = check_float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0,
                                  "rope_local_base_freq", None, "config.json")
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is None:
        return float(theta), local_theta, None
    scaling = {k: v for k, v in dict(scaling).items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.pop("type", None) or scaling.get("rope_type", "default")
    kind = {"su": "longrope"}.get(kind, kind)
    if kind == "default":
        return float(theta), local_theta, None
    if kind not in ROPE_SCALINGS:
        raise LocalLLMError(f"unsupported rope scaling '{kind}'",
                            "localllm supports llama3, linear, longrope and yarn rope scaling")
    scaling["rope_type"] = kind
    if kind == "longrope":
        scaling.setdefault("original_max_position_embeddings",
                           hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
        scaling.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
    if kind == "yarn":
        if scaling.get("original_max_position_embeddings") is None:
            raise damaged("config.json", "gives yarn rope scaling without original_max_position_embeddings")
        if scaling.get("factor") is None:
            longest, original = hf.get("max_position_embeddings"), scaling["original_max_position_embeddings"]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (longest, original)):
                raise damaged("config.json", "gives yarn rope scaling without a factor, and no positive "
                                             "max_position_embeddings / original_max_position_embeddings to derive it")
            scaling["factor"] = float(longest) / float(original)
    return float(theta), local_theta, scaling

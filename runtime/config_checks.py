"""A model's configuration is untrusted input (a ``config.json``, a GGUF header, a manifest): each size
is checked for its type and a sane range as it is read, and against the file's own tensors before the
model is built, so a damaged or hostile file is one line naming the field rather than a traceback or
gigabytes of empty layers built on ``meta``.

Messages name a field as its file spells it (``num_hidden_layers``, ``llama.block_count``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from localllm.errors import LocalLLMError

#: Integer fields of ``ModelConfig`` -> inclusive (lowest, highest). Generous: the largest open models
#: sit far inside; the caps stop a claimed size before anything is built for it.
INT_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "dim": (1, 1 << 17),
    "n_layers": (1, 1024),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),
    "head_dim": (1, 4096),
    "intermediate_size": (1, 1 << 20),
    "max_seq_len": (1, 1 << 27),
    "sliding_window": (1, 1 << 27),
    "n_experts": (1, 1 << 12),
    "n_active": (1, 1 << 12),
    "expert_size": (1, 1 << 20),
    "shared_expert_size": (1, 1 << 20),
}

#: Float fields of ``ModelConfig`` that must be finite and above zero -> their inclusive cap (None: none).
FLOAT_RANGES: dict[str, float | None] = {
    "norm_eps": 1.0,
    "rope_theta": None,
    "rope_local_theta": None,
    "partial_rotary": 1.0,
    "embed_scale": None,
    "attn_scale": None,
    "attn_softcap": None,
    "final_softcap": None,
}

#: Token ids (bos, eos): non-negative integers below this.
MAX_TOKEN_ID = 1 << 31

_REQUIRED = object()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class FieldReader:
    """Reads a config's values by the keys its file gives them, each checked as it is read;
    ``source`` names the file in messages ("config.json", "GGUF metadata")."""

    def __init__(self, values: Mapping[str, Any], source: str) -> None:
        self.values = values
        self.source = source

    def error(self, problem: str) -> LocalLLMError:
        return damaged(self.source, problem)

    def int(self, key: str, field: str | None = None, default: Any = _REQUIRED,
            bounds: tuple[int, int] | None = None) -> Any:
        """The integer at ``key`` within ``field``'s range (or ``bounds``); ``default`` when absent or
        null (a required key raises)."""
        value = self.values.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.error(f"has no {key}")
            return default
        lo, hi = bounds if bounds is not None else INT_RANGES[field]  # type: ignore[index]
        return check_int(value, key, lo, hi, self.source)

    def float(self, key: str, field: str | None = None, default: Any = _REQUIRED,
              cap: float | None = None) -> Any:
        """The finite number above zero at ``key`` (at most ``field``'s cap, or ``cap``); ``default``
        when absent or null."""
        value = self.values.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.error(f"has no {key}")
            return default
        return check_float(value, key, FLOAT_RANGES[field] if field is not None else cap, self.source)


def damaged(source: str, problem: str) -> LocalLLMError:
    """One line: what is wrong in ``source``, and that the file is the problem."""
    return LocalLLMError(f"bad model: its {source} {problem}",
                         f"the model's {source} is damaged or not a model localllm reads: get the model again, "
                         "or use another")


def check_int(value: Any, key: str, lo: int, hi: int, source: str) -> int:
    """``value`` as an int in ``lo..hi``: an integral float is taken, a bool, string or fraction is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__index__"):
        raise damaged(source, f"gives {key} as {_shown(value)}, not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise damaged(source, f"gives {key} as {_shown(value)}, not an integer")
        value = int(value)
    value = int(value)
    if not lo <= value <= hi:
        raise damaged(source, f"gives {key} {value}, outside {lo}..{hi}")
    return value


def check_float(value: Any, key: str, cap: float | None, source: str) -> float:
    """``value`` as a finite float above zero (and at most ``cap``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise damaged(source, f"gives {key} as {_shown(value)}, not a number")
    number = float(value)
    if not math.isfinite(number) or number <= 0 or (cap is not None and number > cap):
        allowed = f"above 0 and at most {cap:g}" if cap is not None else "finite and above 0"
        raise damaged(source, f"gives {key} {_shown(value)}, which must be {allowed}")
    return number


def check_fields(config: Any, source: str = "config") -> None:
    """Every size of a ``ModelConfig`` in its range and of its type (fields that are None are left
    out): what a config built from a dict or by hand gets; one read from a file was checked by key."""
    for name, (lo, hi) in INT_RANGES.items():
        value = getattr(config, name)
        if value is not None:
            setattr(config, name, check_int(value, name, lo, hi, source))
    for name, cap in FLOAT_RANGES.items():
        value = getattr(config, name)
        if value is not None:
            setattr(config, name, check_float(value, name, cap, source))
    if config.bos_token_id is not None:
        config.bos_token_id = check_int(config.bos_token_id, "bos_token_id", 0, MAX_TOKEN_ID, source)
    if not isinstance(config.eos_token_ids, list):
        raise damaged(source, f"gives eos_token_ids as {_shown(config.eos_token_ids)}, not a list")
    config.eos_token_ids = [check_int(i, "eos_token_id", 0, MAX_TOKEN_ID, source) for i in config.eos_token_ids]
    if config.rope_scaling is not None:
        check_rope_scaling(config.rope_scaling, source)


def check_rope_scaling(s: Any, source: str) -> None:
    """The numbers :func:`runtime.model.rope_inv_freq` divides by: finite and above zero."""
    if not isinstance(s, dict):
        raise damaged(source, f"gives rope scaling as {_shown(s)}, not a mapping")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "attention_factor"):
        if s.get(key) is not None:
            check_float(s[key], f"rope scaling's {key}", None, source)
    if s.get("rope_type") == "llama3" and float(s.get("low_freq_factor", 1.0)) == float(s.get("high_freq_factor", 4.0)):
        raise damaged(source, "gives llama3 rope scaling with equal low_freq_factor and high_freq_factor")
    for key in ("short_factor", "long_factor"):
        values = s.get(key)
        if values is not None:
            if not isinstance(values, list):
                raise damaged(source, f"gives rope scaling's {key} as {_shown(values)}, not a list")
            for v in values:
                check_float(v, f"rope scaling's {key}", None, source)


def check_moe(config: Any, source: str = "config") -> None:
    """A MoE config's fields together: all of experts, active experts and their size, or none; at
    most as many active as there are experts; sparse layers that exist, once each."""
    moe = (config.n_experts, config.n_active, config.expert_size)
    if all(v is None for v in moe):
        if config.shared_expert_size is not None or config.moe_layers is not None:
            raise damaged(source, "gives a shared expert or sparse layers without experts")
        return
    if any(v is None for v in moe):
        raise damaged(source, "gives some of the experts' count, active count and size, not all three")
    if config.n_active > config.n_experts:
        raise damaged(source, f"routes each token to {config.n_active} experts of {config.n_experts}")
    layers = config.moe_layers
    if layers is not None:
        if not isinstance(layers, list) or len(set(layers)) != len(layers):
            raise damaged(source, f"gives sparse layers {_shown(layers)}, not a list of distinct layers")
        config.moe_layers = [check_int(i, "a sparse layer", 0, config.n_layers - 1, source) for i in layers]


# --------------------------------------------------------------------------- against the tensors
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
#: One expert's tensor, ``mlp.experts.{e}.gate.weight``: checked as ``mlp.experts.gate.weight``.
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")


def _expected(config: Any, keys: Mapping[str, str]) -> dict[str, list[tuple[int, str]]]:
    """Our tensor names (a layer's without its ``layers.N.`` prefix) -> each dimension as (size, how
    the config gives it), for the plain float names: a quantized layer's packed tensors are not here."""

    def k(field: str) -> str:
        return keys.get(field, field)

    dim = (config.dim, k("dim"))
    vocab = (config.vocab_size, k("vocab_size"))
    inter = (config.intermediate_size, k("intermediate_size"))
    heads = f"{k('n_heads')} x {k('head_dim')}"
    kv_heads = f"{k('n_kv_heads')} x {k('head_dim')}"
    q, kv = (config.q_dim, heads), (config.kv_dim, kv_heads)
    qkv = (config.q_dim + 2 * config.kv_dim, f"{heads} + 2 x {kv_heads}")
    head_dim = (config.head_dim, k("head_dim"))
    out: dict[str, list[tuple[int, str]]] = {
        "embed.weight": [vocab, dim], "output.weight": [vocab, dim], "norm.weight": [dim],
        "attn.q.weight": [q, dim], "attn.k.weight": [kv, dim], "attn.v.weight": [kv, dim],
        "attn.qkv.weight": [qkv, dim], "attn.o.weight": [dim, q],
        "attn.q.bias": [q], "attn.k.bias": [kv], "attn.v.bias": [kv],
        # per head, or OLMoE's over the whole projection
        "attn.q_norm.weight": [q if config.qk_norm_full else head_dim],
        "attn.k_norm.weight": [kv if config.qk_norm_full else head_dim],
        "mlp.gate.weight": [inter, dim], "mlp.up.weight": [inter, dim], "mlp.down.weight": [dim, inter],
        "mlp.gate_up.weight": [(2 * config.intermediate_size, f"2 x {k('intermediate_size')}"), dim],
    }
    if config.n_experts is not None:  # a sparse layer's router, each expert (its index left out) and shared expert
        experts = (config.n_experts, k("n_experts"))
        size = (config.expert_size, k("expert_size"))
        out.update({"mlp.router.weight": [experts, dim], "mlp.experts.gate.weight": [size, dim],
                    "mlp.experts.up.weight": [size, dim], "mlp.experts.down.weight": [dim, size]})
        if config.shared_expert_size is not None:
            shared = (config.shared_expert_size, k("shared_expert_size"))
            out.update({"mlp.shared.gate.weight": [shared, dim], "mlp.shared.up.weight": [shared, dim],
                        "mlp.shared.down.weight": [dim, shared], "mlp.shared_gate.weight": [(1, "1"), dim]})
    for norm in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
        out[f"{norm}.weight"] = [dim]
    return out


def check_tensors(config: Any, tensors: Iterable[tuple[str, str, tuple[int, ...]]], source: str,
                  keys: Mapping[str, str] | None = None) -> None:
    """The config against the file's tensors, from their shapes alone (no data is read).

    ``tensors``: (our name, the file's name, shape as (rows, columns...)) for each tensor of the file
    (fused ones as ``attn.qkv`` / ``mlp.gate_up``); ``keys`` maps config fields to the file's keys for
    the message. The file must hold layers ``0..n_layers-1`` exactly, and every plain weight must have
    the shape the config gives it. Missing tensors are left to the load, which names them.
    """
    keys = keys or {}
    expected = _expected(config, keys)
    layers: set[int] = set()
    for ours, theirs, shape in tensors:
        m = _LAYER.match(ours)
        local = ours
        if m is not None:
            layers.add(int(m.group(1)))
            local = m.group(2)
            e = _EXPERT.match(local)
            if e is not None:
                if config.n_experts is None or int(e.group(1)) >= config.n_experts:
                    raise damaged(source, f"disagrees with the file's tensors: {keys.get('n_experts', 'n_experts')} "
                                          f"gives {config.n_experts} experts, but the file holds {theirs}")
                local = f"mlp.experts.{e.group(2)}"
        want = expected.get(local)
        if want is None:
            continue
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(want):
            raise damaged(source, f"disagrees with the file's tensors: {theirs} has shape {shape}, "
                                  f"expected {len(want)} dimension{'s' if len(want) > 1 else ''}")
        for got, (size, how) in zip(shape, want):
            if got != size:
                raise damaged(source, f"disagrees with the file's tensors: {how} gives {size}, but {theirs} "
                                      f"has shape {shape}")
    want_layers = set(range(config.n_layers))
    if layers != want_layers:
        extra = sorted(layers - want_layers)
        held = f"{len(layers)} layers" + (f" (up to layer {max(layers)})" if extra else "")
        raise damaged(source, f"gives {keys.get('n_layers', 'n_layers')} {config.n_layers}, but the file holds "
                              f"tensors for {held}")

"""The server's settings, and the sizes (``512MB``) and durations (``5m``) its flags and requests use."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.loaders.spec import LoadSpec
from localllm.runtime.cache import DEFAULT_KV_DTYPE

DEFAULT_PORT = 11435
#: Request bodies larger than this are refused (413): a chat of a few hundred thousand words.
DEFAULT_MAX_BODY = 8 << 20
#: Request line and headers together (Go's net/http, which Ollama uses, allows 1 MiB).
DEFAULT_MAX_HEADER_BYTES = 64 << 10
#: An idle keep-alive connection is closed after this long.
DEFAULT_IDLE_TIMEOUT_S = 60.0
#: A client that has not sent a whole request head after this long is disconnected (slowloris).
DEFAULT_HEADER_TIMEOUT_S = 30.0
#: How long an idle model stays loaded (Ollama's default).
DEFAULT_KEEP_ALIVE_S = 300.0

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_size(text: str) -> int:
    """``256MB``, ``1.5GiB``, ``512m``, ``1000000`` -> bytes (1000-based unless ``iB``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise LocalLLMError(f"cannot read the size '{text}'", "write it like 512MB, 2GB or 1GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(value: object) -> float | None:
    """A keep-alive as Ollama takes it: seconds as a number, or a Go-style duration (``5m``, ``1h30m``,
    ``90s``, ``-1``). A negative duration means forever (None); 0 means unload at once."""
    if isinstance(value, bool):
        raise LocalLLMError(f"cannot read the duration {value!r}", "give seconds, or a duration like 5m or 1h")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+(\.\d+)?", text):
            seconds = float(text)
        else:
            m = re.fullmatch(r"(-?)((?:\d+(?:\.\d+)?(?:ms|s|m|h))+)", text)
            if not m:
                raise LocalLLMError(f"cannot read the duration '{value}'", "give seconds, or a duration like 5m or 1h")
            seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", m.group(2)))
            seconds = -seconds if m.group(1) else seconds
    else:
        raise LocalLLMError(f"cannot read the duration {value!r}", "give seconds, or a duration like 5m or 1h")
    return None if seconds < 0 else seconds


@dataclass
class ServerConfig:
    """What ``localllm serve`` was started with."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    #: Sequences one model's engine runs at once (the batch).
    parallel: int = 4
    #: KV cache pool of each loaded model, in bytes (None: the engine's default).
    kv_memory: int | None = None
    #: KV pool storage: "16bit" (the activations' dtype), "fp16" or "int8" (see runtime.cache.KV_DTYPES).
    kv_dtype: str = DEFAULT_KV_DTYPE
    #: Requests that may wait for a slot per model; beyond it, 503 with Retry-After.
    queue: int = 32
    #: Default keep-alive of a loaded model (None: forever).
    keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S
    api_key: str | None = None
    #: Memory for loaded models (weights + KV pool); the least recently used idle one is unloaded
    #: to make room. None: no limit.
    models_memory: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    #: Prompt tokens prefilled per engine step (all sequences together).
    chunk_tokens: int = 256
    #: Speculative decoding: verify tokens proposed from each sequence's own text where it pays.
    speculate: bool = True
    #: How every model is loaded (``run``'s --quant, --device, --dtype, --kernel): :meth:`load_spec`.
    quant: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kernel: str | None = None
    #: Where a model's parts live on a GPU (``run``'s --cpu-moe, --n-cpu-moe, --gpu-layers: LoadSpec's
    #: fields of those names, :mod:`loaders.placement`); neither given: as the memory plan places them.
    cpu_moe: bool = False
    n_cpu_moe: int | None = None
    gpu_layers: int | None = None
    #: Host names (besides addresses, localhost and the bound name) and browser origins (besides
    #: loopback ones) the server answers: :mod:`localllm.server.origins`; "*" for any.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    #: Whether a request may name a model by a path on the server's disk (``--allow-local-paths``);
    #: otherwise names resolve only to store entries, the embedded default and Hub repo ids.
    allow_local_paths: bool = False
    #: A folder whose model files and folders requests may name by their path relative to it
    #: (``--models-dir``), even without ``allow_local_paths``.
    models_dir: Path | None = None
    #: Connection limits (:func:`localllm.server.limits.uvicorn_config` hands them to uvicorn): the
    #: most bytes of request line and headers, seconds an idle keep-alive connection is held, and
    #: seconds a client has to send a request's headers.
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    #: Seconds that in-flight requests get to finish at shutdown before they are cancelled.
    graceful_s: float = 10.0
    #: Starts a background build of a loaded model's compiled decode step, for batches of up to its
    #: second argument (True: started); the command layer's. None: no background builds.
    build_in_background: Callable[[LoadSpec, int], bool] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def load_spec(self, ref: str) -> LoadSpec:
        """How the server loads ``ref``."""
        return LoadSpec(ref, self.device, self.dtype, self.quant, kernel=self.kernel, kv_dtype=self.kv_dtype,
                        cpu_moe=self.cpu_moe, n_cpu_moe=self.n_cpu_moe, gpu_layers=self.gpu_layers)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

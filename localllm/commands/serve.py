"""``localllm serve``: the OpenAI- and Ollama-compatible HTTP server (:mod:`localllm.server`)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import click

from localllm.commands.common import kv_cache_option, note, placement_options, speculate_option, threads_option
from localllm.errors import LocalLLMError
from localllm.quant.formats import ALL_SCHEMES
from localllm.quant.kernels import BY_NAME as KERNELS_BY_NAME
from localllm.server.config import DEFAULT_MAX_BODY, DEFAULT_PORT, ServerConfig, is_loopback, \
    parse_duration, parse_size


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a free port), or a one-line error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LocalLLMError(f"cannot resolve the host '{host}' ({e.strerror})", "give an address such as 127.0.0.1") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise LocalLLMError(f"cannot listen on {host}:{port} ({e.strerror})",
                            "is another server using that port? give --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server_class(uvicorn):  # type: ignore[no-untyped-def]
    """uvicorn's Server, except that a SIGINT/SIGTERM ends ``serve`` normally (exit code 0, "server
    stopped") once shut down, instead of being raised again at the process; a second one forces the
    shutdown (in-flight requests cancelled at once)."""

    class Server(uvicorn.Server):  # type: ignore[misc, name-defined]
        def handle_exit(self, sig: int, frame: object) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

    return Server


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated option's items, blanks dropped."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server reachable from other machines with no key, or None."""
    if is_loopback(host) or api_key:
        return None
    return (f"warning: listening on {host} without an API key: anyone who can reach this machine can use "
            "the server; give --api-key (or LOCALLLM_API_KEY), or bind 127.0.0.1")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="Port (0: any free port).")
@click.option("--parallel", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Sequences one model runs at once (one batch).")
@click.option("--kv-memory", default="256MB", show_default=True, help="KV cache pool of each loaded model.")
@kv_cache_option
@click.option("--queue", type=click.IntRange(0, 100000), default=32, show_default=True,
              help="Requests that may wait per model; more get 503 with Retry-After.")
@click.option("--keep-alive", default="5m", show_default=True,
              help="How long an idle model stays loaded (5m, 1h, 30s; -1: forever; 0: unload at once).")
@click.option("--api-key", envvar="LOCALLLM_API_KEY", help="Require 'Authorization: Bearer KEY' (or LOCALLLM_API_KEY).")
@click.option("--models-memory", help="Memory for loaded models (weights + KV); the least recently used idle model "
                                      "is unloaded to make room. Default: no limit.")
@click.option("--max-body", default=str(DEFAULT_MAX_BODY), show_default=True, help="Largest request body, in bytes.")
@click.option("--quant", "-q", type=click.Choice(ALL_SCHEMES), help="Weight scheme models are loaded in "
                                                                    "(default: each model's own).")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if available), cpu, cuda, cuda:N.")
@click.option("--dtype", default="auto", show_default=True, help="Activations: auto, fp32, fp16, bf16.")
@click.option("--kernel", type=click.Choice(list(KERNELS_BY_NAME)),
              help="Force a matmul kernel, as for run (int4-q8-cpu: int8 activations, faster batches, lossy).")
@placement_options
@threads_option
@speculate_option
@click.option("--allowed-hosts", default="", metavar="NAMES",
              help="Comma-separated host names the server also answers to (besides IP addresses, localhost and "
                   "--host); requests addressed to other names are refused (DNS rebinding). '*': any.")
@click.option("--allowed-origins", envvar="LOCALLLM_ORIGINS", default="", metavar="ORIGINS",
              help="Comma-separated browser origins (https://app.example) that may use the server besides "
                   "loopback pages, with CORS answers (or LOCALLLM_ORIGINS). '*': any.")
@click.option("--allow-local-paths", is_flag=True,
              help="Let requests name models by a path on this machine's disk (by default they name only "
                   "stored models, the default model and Hub repos).")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="A folder whose GGUF files and model folders requests may name by their path inside it.")
@click.option("--preload", multiple=True, metavar="MODEL", help="Load MODEL before serving (repeatable).")
def serve(host: str, port: int, parallel: int, kv_memory: str, kv_cache: str, queue: int, keep_alive: str, api_key: str | None,
          models_memory: str | None, max_body: str, quant: str | None, device: str, dtype: str, kernel: str | None,
          cpu_moe: bool, n_cpu_moe: int | None, gpu_layers: int | None, threads: int | None, speculate: str,
          allowed_hosts: str, allowed_origins: str, allow_local_paths: bool, models_dir: Path | None,
          preload: tuple[str, ...]) -> None:
    """Serve models over HTTP: OpenAI's API under /v1, Ollama's under /api, Prometheus /metrics.

    Models are named as `localllm run` takes them, loaded on first use and kept alive while used.
    Ctrl-C or SIGTERM stops accepting, lets requests in flight finish (10 s), cancels the rest and exits.
    """
    import asyncio

    import uvicorn

    from localllm.commands.compile_step import build_in_background
    from localllm.server.app import create_app, run_serving
    from localllm.server.limits import uvicorn_config
    from localllm.threads import set_threads

    try:
        keep = parse_duration(keep_alive)
    except LocalLLMError as e:
        raise LocalLLMError(f"--keep-alive: {e.message}", e.hint) from None
    config = ServerConfig(host=host, port=port, parallel=parallel, kv_memory=parse_size(kv_memory), kv_dtype=kv_cache, queue=queue,
                          keep_alive_s=keep, api_key=api_key or None,
                          models_memory=parse_size(models_memory) if models_memory else None,
                          max_body_bytes=parse_size(max_body), quant=quant, device=device, dtype=dtype,
                          kernel=kernel, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, gpu_layers=gpu_layers,
                          speculate=speculate == "on", build_in_background=build_in_background,
                          allowed_hosts=split_list(allowed_hosts), allowed_origins=split_list(allowed_origins),
                          allow_local_paths=allow_local_paths, models_dir=models_dir)
    set_threads(threads)
    warning = exposure_warning(host, config.api_key)
    if warning:
        click.echo(warning, err=True)
    sock = bind(host, port)
    config.port = sock.getsockname()[1]
    app = create_app(config)
    server = _server_class(uvicorn)(uvicorn_config(app, config))

    failed: list[BaseException] = []

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.02)
        manager = app.state.server.manager
        try:
            for name in preload:
                note(f"loading {name}...")
                await manager.preload(name)
        except Exception as e:  # noqa: BLE001 - reported once the server has stopped
            failed.append(e)
            server.should_exit = True
            return
        note(f"localllm serving on {config.url}  (OpenAI: {config.url}/v1  Ollama: {config.url}/api)")

    async def main() -> None:
        task = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()

    run_serving(main())
    if failed:
        raise failed[0]
    left = stuck_threads(wait_s=1.0)
    if left:
        note(f"server stopped; {left} request(s) still running in worker threads were left behind")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # Python would wait for those threads before exiting, for as long as they run
    note("server stopped")


def stuck_threads(wait_s: float) -> int:
    """How many threads that would keep the process from exiting (not daemons: a request's work in
    a pooled worker thread, a template render or a tokenizer's) are still running after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sum(thread.is_alive() for thread in others)

"""``localllm serve``: an OpenAI- and Ollama-compatible HTTP server over the batch engine.

Layout (each module small, one concern):

* :mod:`.config` - the server's settings, sizes and durations as users type them;
* :mod:`.errors` - :class:`ApiError` and each API's error body (OpenAI's object, Ollama's string);
* :mod:`.validate` - typed access to a request's JSON fields, each mistake a 400 naming the field;
* :mod:`.models` - loading on first use, keep-alive, the memory budget (LRU eviction of idle models);
* :mod:`.generation` - one request on a model's engine thread, bridged to asyncio as text pieces;
* :mod:`.streaming` - SSE / NDJSON bodies and cancelling on a client's disconnect;
* :mod:`.metrics` - counters and the Prometheus text;
* :mod:`.openai_routes`, :mod:`.ollama_routes` - the two route sets;
* :mod:`.app` - the Starlette app: authentication, the routes, start-up and shutdown.

Why Starlette + uvicorn: Starlette is a small, well-kept ASGI toolkit (routing, requests,
streaming responses that notice a client's disconnect) with no model layer or validation magic we
would have to fight for two APIs' own error shapes; uvicorn is the reference ASGI server (HTTP/1.1
keep-alive, graceful shutdown on SIGINT/SIGTERM), run on uvloop with httptools' parser where they are
installed, as uvicorn's "standard" set does: a streamed token's cost in the event loop is CPU time the
model's step loses on a machine whose cores it all uses. FastAPI would add pydantic validation whose 422
bodies match neither OpenAI's nor Ollama's error shape.

Import :func:`localllm.server.app.create_app` and :class:`localllm.server.config.ServerConfig` from
their modules: this package imports nothing itself, so that the CLI starts without Starlette.
"""

"""localllm: quantized local LLM inference (CLI and paths; the engine lives in runtime/, quant/, loaders/)."""

__version__ = "0.1.0"

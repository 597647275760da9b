"""A small serving engine in plain torch that drives the adapters the way vLLM does.

``model``: a Llama-architecture decoder (the reference engine's configs and safetensors weights)
over a paged KV cache in vLLM's FlashAttention or FlashInfer layout. ``engine``: a scheduler and
worker loop that calls a KV connector exactly in vLLM v1's per-step order. Used by the tests and
``python -m cxlkv.mini_engine`` (one engine process, e.g. prefill or decode of a P/D pair).
"""
from .engine import Engine, EngineConfig, Request
from .model import LlamaConfig, TorchLlama, load_safetensors

__all__ = ["Engine", "EngineConfig", "Request", "LlamaConfig", "TorchLlama", "load_safetensors"]

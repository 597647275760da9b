"""A Llama-architecture decoder in plain torch (fp32) over a paged KV cache.

The same architecture and conventions as cxlkv's C++ reference engine (src/engine/model.h):
RMSNorm (sum of squares in fp64), RoPE in HF's rotate-half convention with inverse frequencies
computed in fp64, grouped-query attention with q scaled by 1/sqrt(head_dim) after RoPE, SwiGLU
MLP, final norm, lm_head (tied to the embedding when absent). Configs are the reference
engine's JSON; weights are HF-named safetensors (F32, F16 or BF16).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

import numpy as np
import torch


@dataclass
class LlamaConfig:
    name: str = "tiny-llama"
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 32768
    seed: int = 1

    @classmethod
    def from_json(cls, text: str) -> "LlamaConfig":
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"model config: unknown keys {sorted(unknown)}")
        return cls(**data)


_DTYPES = {"F32": np.float32, "F16": np.float16}


def load_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors file as fp32 torch tensors (F32, F16, BF16)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if 8 + header_len > len(raw):
        raise ValueError(f"{path}: header of {header_len} bytes runs past the file")
    header = json.loads(raw[8:8 + header_len])
    data = memoryview(raw)[8 + header_len:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name} lies outside the file")
        shape = meta["shape"]
        if meta["dtype"] == "BF16":
            bits = np.frombuffer(data[begin:end], dtype=np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif meta["dtype"] in _DTYPES:
            arr = np.frombuffer(data[begin:end], dtype=_DTYPES[meta["dtype"]]).astype(np.float32)
        else:
            raise ValueError(f"{path}: tensor {name} is {meta['dtype']}; F32, F16 and BF16 are read")
        out[name] = torch.from_numpy(arr.copy()).reshape(shape)
    return out


class TorchLlama:
    """The decoder. ``forward`` computes new tokens' KV into the paged cache and returns their logits."""

    def __init__(self, config: LlamaConfig, weights: Dict[str, torch.Tensor]):
        self.config = c = config
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({n: weights[p + n + ".weight"] for n in (
                "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")})
        half = c.head_dim // 2
        self.inv_freq = torch.tensor([math.pow(c.rope_theta, -2.0 * k / c.head_dim) for k in range(half)],
                                     dtype=torch.float64)

    def layer_names(self) -> List[str]:
        return [f"model.layers.{i}.self_attn" for i in range(self.config.num_layers)]

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ss = x.double().pow(2).mean(dim=-1, keepdim=True)
        inv = (1.0 / torch.sqrt(ss + self.config.rms_norm_eps)).float()
        return w * (x * inv)

    def _rope(self, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = v.shape[-1] // 2
        a, b = v[..., :half], v[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, tokens: List[int], start: int, kv_caches: List[torch.Tensor], block_table: Any,
                block_size: int, layout: str = "flash_attn", on_layer=None) -> torch.Tensor:
        """Tokens at positions [start, start + len(tokens)); the KV of positions < start is in the
        cache. ``block_table``: the request's block ids, or one list per layer (KV cache groups
        with tables of their own). ``on_layer(i, name, kv)`` runs around each layer as vLLM's
        attention does (``("before", ...)`` then ``("after", ...)``). Returns the last token's
        logits."""
        c = self.config
        n = len(tokens)
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        pos = torch.arange(start, start + n, dtype=torch.float64)
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cos(ang).float()[:, None, :], torch.sin(ang).float()[:, None, :]
        x = self.embed[torch.tensor(tokens, dtype=torch.long)]
        total = start + n
        per_layer = block_table if block_table and isinstance(block_table[0], (list, tuple)) else None
        slots = torch.arange(start, total)
        for i, w in enumerate(self.layers):
            table = torch.tensor(per_layer[i] if per_layer else block_table, dtype=torch.long)
            blk, off = table[slots // block_size], slots % block_size
            name = f"model.layers.{i}.self_attn"
            kv = kv_caches[i]
            if on_layer:
                on_layer("before", i, name, kv)
            h = self._rms(x, w["input_layernorm"])
            q = (h @ w["self_attn.q_proj"].T).view(n, nh, hd)
            k = (h @ w["self_attn.k_proj"].T).view(n, nkv, hd)
            v = (h @ w["self_attn.v_proj"].T).view(n, nkv, hd)
            q = self._rope(q, cos, sin) * (1.0 / math.sqrt(hd))
            k = self._rope(k, cos, sin)
            K, V = (kv[0], kv[1]) if layout == "flash_attn" else (kv[:, 0], kv[:, 1])
            K[blk, off] = k
            V[blk, off] = v
            used = table[: (total + block_size - 1) // block_size]
            keys = K[used].reshape(-1, nkv, hd)[:total]
            vals = V[used].reshape(-1, nkv, hd)[:total]
            group = nh // nkv
            keys = keys.repeat_interleave(group, dim=1)  # [total, nh, hd]
            vals = vals.repeat_interleave(group, dim=1)
            scores = torch.einsum("nhd,thd->hnt", q, keys)
            mask = torch.arange(total)[None, :] > (start + torch.arange(n))[:, None]
            scores = scores.masked_fill(mask[None], float("-inf"))
            attn = torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), vals).reshape(n, nh * hd)
            x = x + attn @ w["self_attn.o_proj"].T
            h = self._rms(x, w["post_attention_layernorm"])
            g = h @ w["mlp.gate_proj"].T
            x = x + (torch.nn.functional.silu(g) * (h @ w["mlp.up_proj"].T)) @ w["mlp.down_proj"].T
            if on_layer:
                on_layer("after", i, name, kv)
        last = self._rms(x[-1:], self.norm)
        return (last @ self.lm_head.T)[0]

    def new_kv_caches(self, num_blocks: int, block_size: int, layout: str = "flash_attn",
                      dtype: torch.dtype = torch.float32) -> List[torch.Tensor]:
        c = self.config
        if layout == "flashinfer_hnd":
            # As vLLM's FlashInfer backend does for its HND layout: HND memory, handed out as an
            # NHD-shaped view (the forward pass and the connector see [blocks, 2, bs, heads, hd]).
            hnd = (num_blocks, 2, c.num_kv_heads, block_size, c.head_dim)
            return [torch.zeros(hnd, dtype=dtype).permute(0, 1, 3, 2, 4) for _ in range(c.num_layers)]
        shape = ((2, num_blocks, block_size, c.num_kv_heads, c.head_dim) if layout == "flash_attn"
                 else (num_blocks, 2, block_size, c.num_kv_heads, c.head_dim))
        return [torch.zeros(shape, dtype=dtype) for _ in range(c.num_layers)]


def load_model(config_json: Optional[str], weights_path: str) -> TorchLlama:
    config = LlamaConfig.from_json(config_json) if config_json else LlamaConfig()
    return TorchLlama(config, load_safetensors(weights_path))

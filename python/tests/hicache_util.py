"""What the SGLang backend's tests share: SGLang's page hashes and its storage config's shape."""
import hashlib
from dataclasses import dataclass
from typing import Optional

import torch


def page_hashes(tokens, page, prior=None):
    """SGLang's chained page hashes: sha256 of the previous hash and the page's token ids, hex."""
    out = []
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[i:i + page]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


@dataclass
class HiCacheStorageConfig:
    """sglang.srt.mem_cache.hicache_storage.HiCacheStorageConfig's fields, in its order (commit
    001067fffe33427bee0ed2f007fb7551a1d76b44)."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


def config(tp_rank=0, tp_size=1, mla=False, *, pp=(0, 1), cp=(0, 1), dp=(0, 1), tp_lcm_size=None,
           model="Qwen/Qwen3-8B", **extra):
    return HiCacheStorageConfig(tp_rank, tp_size, pp[0], pp[1], cp[0], cp[1], mla, False, True, model,
                                dp_rank=dp[0], dp_size=dp[1], tp_lcm_size=tp_lcm_size,
                                should_split_heads=bool(tp_lcm_size and tp_lcm_size > tp_size and not mla),
                                extra_config=extra)


def fill(host, seed):
    """Random bytes in every page of a host pool (bf16 values that compare equal to themselves)."""
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))
    return host


def page_indices(host, pages):
    """Token indices of host pages ``pages``, as HiCache passes them (page_size per page)."""
    return torch.cat([torch.arange(p * host.page_size, (p + 1) * host.page_size) for p in pages])

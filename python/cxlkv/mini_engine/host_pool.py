"""SGLang's host KV pool as HiCache and its storage backends see it (a stand-in for
sglang.srt.mem_cache.pool_host's MHATokenToKVPoolHost and MLATokenToKVPoolHost).

The same tensor shapes per layout, the same page accessors (get_data_page, set_from_flat_data_page,
get_dummy_flat_data_page) and the same zero-copy metadata (get_page_buffer_meta,
get_split_heads_page_buffer_meta: the address and size of each piece of a page, in SGLang's
order), computed here from tensor views rather than pointer arithmetic so a wrong offset shows
up as wrong bytes. Token index i of page p is p * page_size + i, as SGLang allocates them.

MHA kv_buffer shapes (K is [0], V is [1]):
  layer_first        [2, layers, tokens, heads, head_dim]
  page_first         [2, tokens, layers, heads, head_dim]
  page_first_direct  [2, pages, layers, page_size, heads, head_dim]
  page_head          [2, pages, heads, page_size, layers, head_dim]
MLA (one latent, no V): the same without the leading 2 and with heads = 1.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


class HostKVPool:
    def __init__(self, *, num_pages: int, page_size: int = 16, layer_num: int = 2, head_num: int = 2,
                 head_dim: int = 8, dtype: torch.dtype = torch.bfloat16, layout: str = "page_first",
                 mla: bool = False):
        if layout not in LAYOUTS or (mla and layout == "page_head"):
            raise ValueError(f"unsupported layout {layout!r}{' for MLA' if mla else ''}")
        self.page_size, self.page_num, self.size = page_size, num_pages, num_pages * page_size
        self.layer_num, self.head_num, self.head_dim = layer_num, 1 if mla else head_num, head_dim
        self.dtype, self.layout, self.mla = dtype, layout, mla
        self.itemsize = torch.empty(0, dtype=dtype).element_size()  # torch.dtype.itemsize is newer than this torch
        L, T, P, S, H, D = layer_num, self.size, num_pages, page_size, self.head_num, head_dim
        dims = {"layer_first": (L, T, H, D), "page_first": (T, L, H, D), "page_first_direct": (P, L, S, H, D),
                "page_head": (P, H, S, L, D)}[layout]
        self.kv_buffer = torch.zeros(dims if mla else (2, *dims), dtype=dtype)
        self._free: List[int] = list(range(num_pages))

    # ---- sizes ----

    def get_size_per_token(self) -> int:
        return self.get_ksize_per_token() * (1 if self.mla else 2)

    def get_ksize_per_token(self) -> int:
        return self.layer_num * self.head_num * self.head_dim * self.itemsize

    @property
    def size_per_token(self) -> int:
        return self.get_size_per_token()

    # ---- allocation (HostKVCache.alloc/free: page_size-aligned runs of token indices) ----

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        pages = -(-need_size // self.page_size)
        if pages > len(self._free):
            return None
        taken, self._free = self._free[:pages], self._free[pages:]
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in taken])[:need_size] \
            if taken else torch.empty(0, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> int:
        self._free.extend(sorted({int(i) // self.page_size for i in indices.tolist()}))
        return len(indices)

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    # ---- pages ----

    def _sides(self) -> List[torch.Tensor]:
        return [self.kv_buffer] if self.mla else [self.kv_buffer[0], self.kv_buffer[1]]

    def _page_views(self, index: int) -> List[torch.Tensor]:
        """The page holding token ``index`` (its first), per side, in the buffer's own shape."""
        p, s = int(index) // self.page_size, self.page_size
        t = p * s
        if self.layout == "layer_first":
            return [side[:, t:t + s] for side in self._sides()]
        if self.layout == "page_first":
            return [side[t:t + s] for side in self._sides()]
        return [side[p:p + 1] for side in self._sides()]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        views = self._page_views(index)
        page = torch.stack(views) if len(views) > 1 else views[0]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self.get_size_per_token() // self.itemsize, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        views = self._page_views(index)
        n = views[0].numel()
        for i, view in enumerate(views):
            view.copy_(data_page[i * n:(i + 1) * n].reshape(view.shape))

    # ---- zero-copy metadata (SGLang's HostKVCache.get_page_buffer_meta) ----

    def get_page_buffer_meta(self, indices: torch.Tensor) -> Tuple[List[int], List[int]]:
        """Per page (each page_size run of ``indices``): layer_first gives K and V of every layer
        (K0 V0 K1 V1 ...; MLA: one per layer), the page layouts K then V (MLA: one piece)."""
        assert len(indices) % self.page_size == 0
        ptrs: List[int] = []
        sizes: List[int] = []
        for first in indices.tolist()[::self.page_size]:
            views = self._page_views(first)
            if self.layout == "layer_first":
                pieces = [views[side][layer] for layer in range(self.layer_num) for side in range(len(views))]
            else:
                pieces = views
            for piece in pieces:
                ptrs.append(piece.data_ptr())
                sizes.append(piece.numel() * piece.element_size())
        return ptrs, sizes

    def get_split_heads_page_buffer_meta(self, indices: torch.Tensor, split_factor: int) -> Tuple[List[int], List[int]]:
        """page_head only: per page, per head group (head_num / split_factor heads), K then V."""
        assert self.layout == "page_head" and not self.mla and self.head_num % split_factor == 0
        group = self.head_num // split_factor
        ptrs: List[int] = []
        sizes: List[int] = []
        for first in indices.tolist()[::self.page_size]:
            k, v = self._page_views(first)
            for g in range(split_factor):
                for side in (k, v):
                    piece = side[0, g * group:(g + 1) * group]
                    ptrs.append(piece.data_ptr())
                    sizes.append(piece.numel() * piece.element_size())
        return ptrs, sizes

    def get_hybrid_pool_buffer(self) -> List[torch.Tensor]:
        return self._sides()

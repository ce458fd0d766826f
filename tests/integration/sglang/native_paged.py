"""SGLang's own paged allocator as the tests' reference, on every release.

SGLang 0.5.17, 0.5.20 and 0.5.21's ``alloc_extend`` / ``alloc_decode`` launch their
Triton kernel before counting the new pages: when the free list is shorter
than the batch needs, the kernel reads past its end and only then does the
method answer ``None`` (0.5.22 counts first: "both kernels read past
free_pages when it is not [deep enough]"). On a GPU that read is garbage that
is thrown away; in Triton's interpreter, which runs the kernels on the CPU
machines (conftest.py), it is a real out-of-bounds read of host memory and can
crash the process. So on those two releases the reference is SGLang's class
with 0.5.22's count put in front of each call: a miss answers ``None`` before
the kernel runs, exactly as SGLang answers after it; every allocation that
fits runs SGLang's own code unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator import paged as _paged

from kvcached.integrations.patching import release
from kvcached.integrations.sglang.patch import sglang_version

COUNTS_AFTER_KERNEL = ("0.5.17", "0.5.20", "0.5.21")


class _CountFirst(PagedTokenToKVPoolAllocator):
    def _fits(self, num_new_pages: int) -> bool:
        if num_new_pages > len(self.free_pages):
            self.merge_and_sort_free()  # SGLang merges staged frees before its kernel
        return num_new_pages <= len(self.free_pages)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | None:
        pages = _paged.get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
        )
        if not self._fits(int(pages)):
            return None
        return super().alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, *args, **kwargs
        )

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        pages = _paged.get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True
        )
        if not self._fits(int(pages)):
            return None
        return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)


def paged_reference(*args: Any, **kwargs: Any) -> PagedTokenToKVPoolAllocator:
    """``PagedTokenToKVPoolAllocator(*args, **kwargs)``, count-first on 0.5.20/0.5.21."""
    if release(sglang_version() or "") in COUNTS_AFTER_KERNEL:
        return _CountFirst(*args, **kwargs)
    return PagedTokenToKVPoolAllocator(*args, **kwargs)

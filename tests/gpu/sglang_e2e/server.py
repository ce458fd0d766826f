"""One SGLang HTTP server in its own process group (the vLLM runner's process
handling and OpenAI client, with SGLang's command line and cache flush)."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.kvharness.gpu_server import Server, post


class SGLangServer(Server):
    """``python -m sglang.launch_server ARGS``; ``args`` come from
    :func:`tests.gpu.sglang_e2e.checks.server_args` (model, name and port included)."""

    def __init__(
        self, name: str, port: int, args: list[str], env: dict[str, str], log: Path
    ) -> None:
        super().__init__(name, port, "", [], env, log)
        self.argv = [sys.executable, "-m", "sglang.launch_server", *args]

    def reset_prefix_cache(self) -> int:
        """SGLang's ``/flush_cache``: the radix tree reset and every KV page
        freed (kvcached unmaps them); 200 once done."""
        return post(self.url("/flush_cache"), None)[0]

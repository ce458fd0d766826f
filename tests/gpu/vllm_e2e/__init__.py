"""The seed PR's GPU test plan for vLLM, run against real vLLM servers on a GPU.

``python -m tests.gpu.vllm_e2e --out DIR`` (README there): per model three
cases (kvcached contiguous, kvcached per-layer, native), each phase's requests
compared token by token and by top-5 logprobs with native, plus the elastic,
limit and co-start cases. Writes ``DIR/summary.json`` and one log per server.
"""

"""The seed PR's SGLang GPU cases, run against real SGLang 0.5.17 servers on one GPU.

``python -m tests.gpu.sglang_e2e --out DIR [--cases models limit elastic]``: per model
three servers (kvcached "contiguous", kvcached "non-contiguous", native), every phase
compared with native token by token, by top-5 logprobs and by ``cached_tokens``; the
two kvcached servers co-started; the limit case; the elastic pair. One
``DIR/summary.json`` (``{"cases": {CASE: {CHECK: bool}}}`` with commit, command,
device and SGLang version), ``DIR/details.json`` and the servers' logs.

Needs a GPU, the gpu-sglang bundle installed (``tools/gpu-sglang``: SGLang 0.5.17 with
kvcached, and its ``make_model.py``). The check logic is in :mod:`.checks` (no GPU,
no SGLang: ``tests/gpu/sglang_e2e/test_checks.py`` runs in CI); the steps and the
run's frame it shares with the vLLM runner in ``tests/gpu/e2e_cases.py`` and
``tests/gpu/e2e_run.py``.
"""

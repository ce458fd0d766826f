"""The seed PR's GPU test plan for vLLM, run against real vLLM servers on a GPU.

* ``python -m tests.gpu.vllm_e2e --out DIR [--models ...] [--graphs] [--runner v1]``:
  per model three cases (kvcached contiguous, kvcached per-layer, native), every
  phase's requests compared with native token by token and by top-5 logprobs,
  and the co-start of the two kvcached servers; ``--runner`` picks vLLM 0.26's
  model runner for every server (its default is V2 for dense models);
* ``python -m tests.gpu.vllm_e2e.limit --out DIR``: the limit case;
* ``python -m tests.gpu.vllm_e2e.elastic --out DIR``: the elastic case.

Each writes ``DIR/summary.json`` (``{"cases": {CASE: {CHECK: bool}}}`` with
provenance) and its servers' logs; ``tests/compat/table.py`` makes the README's
row from the summaries under ``benchmarks/results/h200/vllm-VERSION/``. Needs a
GPU, vLLM with kvcached installed, and the gpu-vllm bundle's ``make_model.py``.

The models, the server and the prompts are shared with the GPU benchmarks and live
in ``benchmarks/kvharness`` (``gpu_models``, ``gpu_server``, ``gpu_prompts``); run
from the repository root, this package imports them as ``benchmarks.kvharness``.
What it shares with ``tests/gpu/sglang_e2e`` lives in ``tests/gpu``: the cases'
steps (``e2e_cases``) and the multi-case run's frame (``e2e_run``).
"""

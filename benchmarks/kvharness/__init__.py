"""What the benchmarks and the tests share: the vLLM server harness, the tiny model,
and the GPU runs' models, server and prompts.

It lives under ``benchmarks/`` because ``python benchmarks/X.py`` puts only that
folder on the import path; pytest puts it there too (``pythonpath`` in
``pyproject.toml``), so a test imports ``kvharness.vllm_server`` exactly as a
benchmark does. ``python -m tests.gpu.vllm_e2e`` runs from the repository root,
where it is ``benchmarks.kvharness``. The modules here import each other
relatively, so either name works; nothing here imports an engine at module level.
"""

"""The plan's models: published shapes with seeded random weights made on the device.

The GPU machine has no model hub, so each model is its architecture's published
config plus a test tokenizer and seeded random-normal bf16 weights written as
safetensors by the gpu-vllm bundle's ``make_model.py`` (vLLM's real loader
then reads them; greedy outputs don't cycle as ``--load-format dummy``'s do).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Mistral-7B-v0.1's published shape, with its sliding window cut to 1024 tokens
#: and every 4th layer full attention (Gemma-3's and GPT-OSS's interleave), so the
#: KV cache has two groups (sliding and full) sharing each KV tensor, and the
#: plan's longer prompts cross the window.
MISTRAL_HYBRID = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 1024,
    "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(32)],
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 32000,
}

#: name -> the tokenizer make_model writes ("word-level": w3 ..; "byte-level": w, wa ..),
#: the server's --max-model-len, extra server arguments, and a shape make_model lacks.
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"tokenizer": "byte-level", "max_model_len": 4096},
    "llama-3.1-8b": {"tokenizer": "word-level", "max_model_len": 4096},
    "llama-3.2-1b": {"tokenizer": "word-level", "max_model_len": 4096},
    "mistral-7b-hybrid-swa": {
        "tokenizer": "word-level",
        "max_model_len": 4096,
        "shape": MISTRAL_HYBRID,
    },
}


def make_model(name: str, out: Path, make_model_py: str) -> Path:
    """Write model ``name`` to ``out`` (once: an existing folder is reused), in a
    process of its own: make_model creates the weights on the GPU, and torch's
    caching allocator would keep those ~16 GB (an 8B shape) reserved in this
    process for the rest of the run, out of every engine's and ledger's memory."""
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    if not Path(make_model_py).is_file():
        raise FileNotFoundError(f"--make-model {make_model_py}: not the bundle's make_model.py")
    # This file as the child's script: it imports nothing of the repository.
    subprocess.run(
        [sys.executable, __file__, name, str(out.resolve()), str(Path(make_model_py).resolve())],
        check=True,
        timeout=600,
    )
    return out


def make_model_here(name: str, out: Path, make_model_py: str) -> Path:
    """:func:`make_model` in this process (its child runs this)."""
    spec = importlib.util.spec_from_file_location("gv_make_model", make_model_py)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"--make-model {make_model_py}: not the bundle's make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shape = MODELS[name].get("shape")
    if shape is not None:
        mod.SHAPES[name] = shape
    argv = sys.argv
    sys.argv = [make_model_py, "--shape", name, "--out", str(out)]
    try:
        mod.main()
    finally:
        sys.argv = argv
    return out


def case_arguments(parser: Any, port: int) -> None:
    """The arguments every single-case runner (limit, elastic) takes."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs on")
    parser.add_argument("--models-dir", default="/tmp/e2e-models")
    parser.add_argument("--make-model", default=".gpu/vllm/make_model.py")
    parser.add_argument("--port", type=int, default=port)


def prepare(args: Any) -> tuple[Path, str, Path, list[str]]:
    """(output folder, the model's tokenizer kind, its folder, server arguments)
    for a case parsed with :func:`case_arguments`."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = MODELS[args.model]
    path = make_model(args.model, Path(args.models_dir) / args.model, args.make_model)
    extra = ["--max-model-len", str(spec["max_model_len"]), "--seed", "0"]
    if not args.graphs:
        extra.append("--enforce-eager")
    return out, spec["tokenizer"], path, extra


if __name__ == "__main__":  # make_model's child: NAME OUT MAKE_MODEL_PY
    make_model_here(sys.argv[1], Path(sys.argv[2]), sys.argv[3])

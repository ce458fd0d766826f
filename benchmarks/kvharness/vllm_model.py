"""The tiny Llama the vLLM tests serve: a ``config.json`` and, by default,
seeded random weights.

Why not vLLM's ``--load-format dummy``: its weights are so small (uniform in
+-1e-3) that attention is flat and greedy output depends on the last prompt token
alone (measured: six different 300-token prefixes before one 10-token tail all
gave the same 16 tokens), so equal tokens would not show that a KV cache holds
the right values. With the weights written here the same experiment gives six
different answers, and two fresh servers still agree token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

# The tiny Llama of ENGINES.md. The CPU attention backend takes head sizes
# 32, 64, 80, ... and block sizes that are multiples of 32.
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 256, 2, 4, 2, 32, 512
TINY_LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_llama(directory: Path, weights_seed: int | None = 0) -> Path:
    """Write the tiny Llama into ``directory`` (created) and return it, ready
    for ``--model``: its ``config.json``, and unless ``weights_seed`` is None
    seeded random weights in ``model.safetensors`` (serve those with
    ``ServerOptions(load_format="safetensors")``, the default)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=1))
    if weights_seed is not None:
        _write_random_weights(directory / "model.safetensors", weights_seed)
    return directory


def _write_random_weights(path: Path, seed: int) -> None:
    """Llama weights drawn from N(0, gain^2 / fan_in), norms at one. The larger
    gain on q and k sharpens attention, so every token of the context matters."""
    import torch  # imported here: the server helpers need only the standard library
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * (gain / cols**0.5)).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(HIDDEN, dtype=torch.bfloat16)

    weights = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16),
        "model.norm.weight": ones(),
        "lm_head.weight": linear(VOCAB, HIDDEN),
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        weights[p + "self_attn.q_proj.weight"] = linear(HEADS * HEAD_DIM, HIDDEN, 3.0)
        weights[p + "self_attn.k_proj.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN, 3.0)
        weights[p + "self_attn.v_proj.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN)
        weights[p + "self_attn.o_proj.weight"] = linear(HIDDEN, HEADS * HEAD_DIM)
        weights[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
        weights[p + "input_layernorm.weight"] = ones()
        weights[p + "post_attention_layernorm.weight"] = ones()
    save_file(weights, str(path))

"""Two tiny Llamas of different shapes, each with an offline tokenizer, for the
real vLLM servers behind ``kvcached serve``.

vLLM's dummy weights are enough here (``--load-format dummy``): these tests
compare the router's answers with the engine's own for the same request, and
an engine's greedy output before and after a sleep, not attention quality.
The tokenizer is a word-level one over the vocabulary (``w3`` ... ``w511``) with
a one-line chat template, built offline (ENGINES.md), so text completions and
chat work through the ``openai`` client.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvharness.vllm_model import TINY_LLAMA_CONFIG

VOCAB = 512
SHAPES: dict[str, dict[str, int]] = {
    # hidden, layers, heads, KV heads, head_dim: two different KV geometries
    "alpha": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "beta": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
    },
}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def write_model(directory: Path, shape: str) -> Path:
    """A model directory vLLM serves with ``--load-format dummy``: config and tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    # The vLLM tests' tiny Llama (alpha is its shape), reshaped and with a shorter context.
    config = {
        **TINY_LLAMA_CONFIG,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        **SHAPES[shape],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(directory))
    return directory


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def dummy_vllm_args(max_model_len: int, max_num_seqs: int) -> list[str]:
    """A vLLM CPU engine's arguments for these models: dummy weights, eager,
    32-token blocks, ``max_model_len`` tokens, ``max_num_seqs`` at once."""
    return [
        "--load-format",
        "dummy",
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
    ]

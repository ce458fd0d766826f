#!/usr/bin/env python3
"""Make a model folder for vLLM or SGLang from a built-in public shape (gpu-sglang bundle, device
side; a copy of gpu-vllm's make_model.py, engine-neutral).

  python3 make_model.py --shape llama-3.1-8b|llama-3.2-1b|qwen2.5-0.5b --out DIR
                        [--dummy-only] [--seed 0] [--device cuda|cpu]

Writes DIR/config.json (the architecture's published hyperparameters) and a minimal
tokenizer with a one-line chat template, so text prompts and chat work: for Llama a
`tokenizers` WordLevel model over the whole vocabulary (`<unk>` 0, `<s>` 1, `</s>` 2, then the
words w3 ... w<vocab-1>, "w17 w42 w99") with a Whitespace pre-tokenizer; for Qwen2, whose
tokenizer transformers 5 rebuilds as a byte-level BPE from tokenizer.json, byte-level words
w, wa ... wz, waa ... ("wab wcd wq"). Any other word is `<unk>` (Llama) or bytes (Qwen2).
bos/eos are set to 1/2 to match. Unless --dummy-only, `transformers` also creates the weights
(bf16, seeded, normal with std = initializer_range = 0.02, norms 1) on the GPU and saves
them as safetensors (5 GB shards), so vLLM serves them through its real safetensors loader
and greedy outputs are not the short cycles of `--load-format dummy`. Serve a --dummy-only
folder with `--load-format dummy`. Prints the timings as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "use_cache": True,
    "vocab_size": 128256,
}

#: Published configs (meta-llama/Llama-3.1-8B, meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-0.5B).
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 151936,
    },
}

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def config_for(shape: str) -> dict:
    import transformers

    cfg = dict(SHAPES[shape])
    # transformers_version >= 5 also tells transformers' Mistral-regex check that it can stay quiet
    cfg.update(
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        dtype="bfloat16",
        transformers_version=transformers.__version__,
    )
    return cfg


#: Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer); digits come out one by one.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _word_level(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _byte_level_words(vocab_size: int):
    """For model types whose transformers tokenizer class rebuilds a byte-level BPE from
    tokenizer.json's vocab and merges whatever tokenizer.json says (Qwen2Tokenizer in
    transformers 5): `<unk>` `<s>` `</s>`, the 256 byte symbols, then the words " w", " wa" ...
    " wz", " waa" ... (letters only, since that split cuts digits), each merged from its prefix."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges, frontier = [("\u0120", "w")], ["\u0120w"]  # \u0120 is the byte-level space
    vocab["\u0120w"] = len(vocab)
    while len(vocab) < vocab_size:
        nxt = []
        for p in frontier:
            for c in "abcdefghijklmnopqrstuvwxyz":
                if len(vocab) >= vocab_size:
                    break
                vocab[p + c] = len(vocab)
                merges.append((p, c))
                nxt.append(p + c)
        frontier = nxt
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def write_tokenizer(out: str, cfg: dict) -> str:
    from transformers import PreTrainedTokenizerFast

    byte_level = cfg["model_type"] == "qwen2"
    tok = (_byte_level_words if byte_level else _word_level)(cfg["vocab_size"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return (
        "byte-level words: w wa .. wz waa .."
        if byte_level
        else f"WordLevel: w3 .. w{cfg['vocab_size'] - 1}"
    )


def write_weights(out: str, cfg: dict, seed: int, device: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t = time.time()
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_create = time.time() - t
    n = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        std = float(model.get_input_embeddings().weight[:4096].float().std())
    t = time.time()
    model.save_pretrained(out, max_shard_size="5GB")
    t_save = time.time() - t
    with open(
        os.path.join(out, "config.json"), "w"
    ) as f:  # the published form, as for --dummy-only
        json.dump(cfg, f, indent=2)
    size = sum(
        os.path.getsize(os.path.join(out, x)) for x in os.listdir(out) if x.endswith(".safetensors")
    )
    return {
        "params": n,
        "embed_std": round(std, 4),
        "create_s": round(t_create, 2),
        "save_s": round(t_save, 2),
        "safetensors_GB": round(size / 1e9, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dummy-only", action="store_true", help="config + tokenizer, no weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    a = ap.parse_args()
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    for x in os.listdir(a.out):  # no stale shards from an earlier run
        if x.endswith(".safetensors") or x.endswith(".safetensors.index.json"):
            os.remove(os.path.join(a.out, x))
    cfg = config_for(a.shape)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    t = time.time()
    words = write_tokenizer(a.out, cfg)
    res: dict = {
        "shape": a.shape,
        "out": a.out,
        "tokenizer": words,
        "tokenizer_s": round(time.time() - t, 2),
    }
    if not a.dummy_only:
        device = a.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        res.update(device=device, seed=a.seed, **write_weights(a.out, cfg, a.seed, device))
    res["total_s"] = round(time.time() - t0, 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

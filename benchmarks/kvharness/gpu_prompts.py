"""The plan's prompts, made from words each model's test tokenizer has.

The models are made on the device (``make_model.py``): Llama-family shapes get a
word-level tokenizer over ``w3 .. w<vocab-1>``, Qwen2 a byte-level one whose
words are ``w``, ``wa`` .. ``wz``, ``waa`` ... A seeded RNG picks words, so every
case of a model sends byte-identical prompts.
"""

from __future__ import annotations

import random
import string

SHORT = 6
LONG_WORDS = (300, 900, 1800)
DOC_WORDS = 1300
QUESTIONS = 4


def word_maker(tokenizer: str, seed: int):  # noqa: ANN201 - returns a nullary str function
    rng = random.Random(seed)
    if tokenizer == "word-level":
        return lambda: f"w{rng.randint(3, 30000)}"
    letters = string.ascii_lowercase
    return lambda: "w" + "".join(rng.choice(letters) for _ in range(2))


def text(words, n: int) -> str:  # noqa: ANN001
    return " ".join(words() for _ in range(n))


def gen_prompts(tokenizer: str) -> list[str]:
    """gen_seq / gen_conc: 6 short prompts, then ~300, ~900 and ~1800 words."""
    words = word_maker(tokenizer, 1)
    return [text(words, 8 + 4 * i) for i in range(SHORT)] + [text(words, n) for n in LONG_WORDS]


def apc_prompts(tokenizer: str) -> list[str]:
    """apc: 4 questions after one shared ~1300-word document."""
    words = word_maker(tokenizer, 2)
    doc = text(words, DOC_WORDS)
    return [f"{doc} {text(words, 6)}" for _ in range(QUESTIONS)]

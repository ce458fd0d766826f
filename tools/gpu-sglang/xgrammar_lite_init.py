"""xgrammar 0.2.1 without its compiled library (gpu-sglang bundle).

SGLang 0.5.17 imports ``xgrammar.StructuralTag`` (and the structural-tag format
models) at module level in its function-call and OpenAI-protocol code; those
are pure-Python pydantic models, kept here. The grammar compiler and matcher
live in ``libxgrammar_bindings.so`` (53 MB), left out of the bundle: serve with
``--grammar-backend none``. Any other name raises ImportError naming this.
"""

from . import structural_tag
from .builtin_structural_tag import get_model_structural_tag
from .structural_tag import StructuralTag

__version__ = "0.2.1"
__all__ = ["StructuralTag", "get_model_structural_tag", "structural_tag"]


def __getattr__(name: str):
    raise AttributeError(
        f"xgrammar.{name}: this is the gpu-sglang bundle's xgrammar without its compiled "
        "library (grammar-constrained decoding is not available; use --grammar-backend none)"
    )

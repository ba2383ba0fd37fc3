"""brisk-lm: fast, hackable LLM inference in PyTorch.

    import brisklm
    llm = brisklm.load()          # bundled SmolLM2-135M-Instruct, or a path
    llm.generate("The capital of France is", max_new_tokens=16)
"""
from .api import LLM
from .loading import LoadOptions, load
from .errors import BriskError

__all__ = ["LLM", "load", "LoadOptions", "BriskError"]
__version__ = "0.1.0"

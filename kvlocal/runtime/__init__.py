"""The only place that talks to llama.cpp.

``library`` loads llama-cpp-python, checks its version and detects kvlocal's patch series;
``llama`` wraps a model and a context with the low-level API (kvlocal runs its own decode loop,
because ``Llama.eval`` assumes cell i = position i, which stops being true after eviction).
"""

from .library import REQUIRED_LLAMA_CPP_PYTHON, RuntimeInfo, runtime_info
from .llama import Context, Model

__all__ = ["REQUIRED_LLAMA_CPP_PYTHON", "RuntimeInfo", "runtime_info", "Model", "Context"]

"""kvlocal: long-context local LLM inference inside a fixed KV-cache budget, on llama.cpp.

The llama.cpp runtime is loaded on first use (``kvlocal.runtime``); ``kvlocal.runtime.runtime_info()``
says whether it is kvlocal's patched build or a stock one.
"""

from kvlocal.version import __version__


def __getattr__(name):  # kvlocal.Chat without loading llama.cpp on `import kvlocal`
    if name in ("Chat", "ChatStats", "ChatSettings"):
        from kvlocal import chat

        return getattr(chat, name)
    if name == "Llama":  # llama-cpp-python's chat API on kvlocal
        from kvlocal.llama_compat import Llama

        return Llama
    raise AttributeError(f"module 'kvlocal' has no attribute {name!r}")

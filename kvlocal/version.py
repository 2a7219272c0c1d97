"""kvlocal's version, in a module of its own: every layer may read it without importing the package's face
(``kvlocal/__init__.py``, which reaches up to the chat)."""

__version__ = "0.1.0"

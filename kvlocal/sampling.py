"""Next-token choice from a logits vector. The sampler runs llama.cpp's sampler chain, so it lives
in :mod:`kvlocal.runtime.sampler` (the only package that talks to llama.cpp); this name stays for
the engine, the session and scripts."""

from .runtime.sampler import Sampler, SamplerParamError

__all__ = ["Sampler", "SamplerParamError"]

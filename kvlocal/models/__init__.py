"""Where models come from: the known models and the model cache (``registry``), Hugging Face pulls
(``hub``), GGUF file checks (``gguf_file``) and the attention shapes kvlocal reads from a file's
metadata (``arch``). Nothing here loads llama.cpp."""

from kvlocal.models.registry import (DEFAULT_MODEL, KNOWN_MODELS, KnownModel, WheelPart, cache_dir, cached_models,
                                     cached_path, models_dir, pull, pull_model, resolve, sha256_file)

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "KnownModel", "WheelPart", "cache_dir", "cached_models", "cached_path",
           "models_dir", "pull", "pull_model", "resolve", "sha256_file"]

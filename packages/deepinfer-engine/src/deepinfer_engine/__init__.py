"""deepinfer-engine: see the package README for what it owns and what it may import.

Public API: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`, `EngineConfig`. They are imported
lazily (PEP 562) so that `deepinfer_engine.core` stays importable without torch.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("deepinfer-engine")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

_LAZY = {
    "LLM": "deepinfer_engine.llm",
    "SamplingParams": "deepinfer_engine.sampling_params",
    "RequestOutput": "deepinfer_engine.outputs",
    "CompletionOutput": "deepinfer_engine.outputs",
    "EngineConfig": "deepinfer_engine.config",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig", "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer_engine' has no attribute {name!r}")
    return getattr(import_module(module), name)

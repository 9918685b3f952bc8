"""deepinfer-kernels: see the package README for what it owns and what it may import."""

from importlib.metadata import PackageNotFoundError, version

from deepinfer_kernels._backend import KernelBackendError, backend_from_env

try:
    __version__ = version("deepinfer-kernels")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = ["KernelBackendError", "__version__", "backend_from_env"]

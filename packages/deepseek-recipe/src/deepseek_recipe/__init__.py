"""deepseek-recipe: see the package README for what it owns and what it may import."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("deepseek-recipe")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = ["__version__"]

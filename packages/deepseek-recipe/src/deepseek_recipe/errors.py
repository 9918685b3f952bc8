"""Error types of the recipe (same names as the official wheel)."""

from __future__ import annotations

from . import _json

__all__ = ["ConversionError", "ImageError", "CalcResizeError"]


class ConversionError(Exception):
    """Raised when a protocol request is invalid or cannot be converted (HTTP 400)."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = _json.dumps_compact(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": param,
                    "code": "invalid_request_error",
                }
            }
        )


class ImageError(Exception):
    """A failure to resolve, fetch or preprocess images (not implemented in pure Python)."""

    def __init__(self, message: str, *, kind: str = "Unsupported", is_retryable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.is_retryable = is_retryable


class CalcResizeError(ValueError):
    """The image token calculation did not converge."""

"""Image-handling names of the official wheel, as pure-Python stand-ins.

The official wheel fetches images over HTTP (reqwest) and preprocesses them
with OpenCV. This package is a torch/OpenCV-free text layer: the containers
(`ImageInfo`, `MultiModalData`, `ImageQuota`, `PreprocessOptions`) exist so
callers can pass data around, while fetching and preprocessing raise
`ImageError(kind="Unsupported")`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .errors import ImageError

__all__ = [
    "ImageInfo",
    "MultiModalData",
    "ImageQuota",
    "PreprocessOptions",
    "ReqwestImageFetcher",
    "OpenCvImagePreprocessor",
    "ImageResolver",
]

_DETAILS = ("low", "high", "original", "auto")


class ImageInfo:
    """A preprocessed image: encoded bytes and its size in pixels."""

    __slots__ = ("_data", "_width", "_height")

    def __init__(self, data: bytes, width: int, height: int) -> None:
        for name, v in (("width", width), ("height", height)):
            if type(v) is not int or v < 0:
                raise ValueError(f"ImageInfo.{name} must be a non-negative int, got {v!r}")
        self._data, self._width, self._height = bytes(data), width, height

    data = property(lambda self: self._data)
    width = property(lambda self: self._width)
    height = property(lambda self: self._height)


class MultiModalData:
    """Images in the order their placeholders appear in a prompt."""

    __slots__ = ("_images",)

    def __init__(self, images: Sequence[ImageInfo] | None = None) -> None:
        self._images = list(images or ())

    @property
    def images(self) -> list[ImageInfo]:
        return list(self._images)

    def is_empty(self) -> bool:
        return not self._images

    def image_token_adjustment(self) -> int:
        if not self._images:
            return 0
        raise ImageError(
            "image token counting (V4.1 image token spec) is not implemented in the pure-Python recipe",
            kind="Unsupported",
        )


class ImageQuota:
    """Image count and encoded bytes recorded by completed resolve calls of one request."""

    __slots__ = ("_count", "_bytes")

    def __init__(self) -> None:
        self._count = 0
        self._bytes = 0

    def image_count(self) -> int:
        return self._count

    def byte_size(self) -> int:
        return self._bytes


class PreprocessOptions:
    """Options of one preprocessing operation."""

    __slots__ = ("_detail", "_max", "_low_max")

    def __init__(self, detail: str, max_dimension_px: int, low_detail_max_dimension_px: int) -> None:
        if detail not in _DETAILS:
            raise ValueError(f'invalid detail "{detail}"; expected "low", "high", "original", or "auto"')
        self._detail, self._max, self._low_max = detail, max_dimension_px, low_detail_max_dimension_px

    detail = property(lambda self: self._detail)
    max_dimension_px = property(lambda self: self._max)
    low_detail_max_dimension_px = property(lambda self: self._low_max)


class ReqwestImageFetcher:
    """Stand-in for the official HTTP image fetcher; fetching is unsupported here."""

    __slots__ = ("_max_bytes", "_filter")

    def __init__(self) -> None:
        self._max_bytes = None
        self._filter = None

    @staticmethod
    def with_max_bytes(max_bytes: int) -> ReqwestImageFetcher:
        f = ReqwestImageFetcher()
        f._max_bytes = max_bytes
        return f

    def with_destination_filter(self, destination_filter: Callable[[str, str], bool]) -> ReqwestImageFetcher:
        if not callable(destination_filter):
            raise TypeError("destination_filter must be callable")
        f = ReqwestImageFetcher()
        f._max_bytes, f._filter = self._max_bytes, destination_filter
        return f

    def fetch(self, url: str) -> bytes:
        raise ImageError(
            f"fetching {url!r}: image fetching is not supported by the pure-Python recipe", kind="Unsupported"
        )


class OpenCvImagePreprocessor:
    """Stand-in for the official OpenCV preprocessor; preprocessing is unsupported here."""

    def preprocess(self, data: bytes, options: PreprocessOptions) -> ImageInfo:
        raise ImageError("image preprocessing is not supported by the pure-Python recipe", kind="Unsupported")


class ImageResolver:
    """Resolves image sources with a fetcher and a preprocessor (unsupported for any non-empty input)."""

    def __init__(self, fetcher: ReqwestImageFetcher, preprocessor: OpenCvImagePreprocessor) -> None:
        self._fetcher, self._preprocessor = fetcher, preprocessor

    def resolve(self, sources, quota: ImageQuota) -> MultiModalData:
        sources = list(sources)
        if not sources:
            return MultiModalData()
        raise ImageError("image resolution is not supported by the pure-Python recipe", kind="Unsupported")

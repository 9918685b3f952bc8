"""Image-handling names of the official wheel, as pure-Python stand-ins.

The official wheel fetches images over HTTP (reqwest) and preprocesses them
with OpenCV. This package is a torch/OpenCV-free text layer: the containers
(`ImageInfo`, `MultiModalData` with its image-token arithmetic, `ImageQuota`,
`PreprocessOptions`) exist so callers can pass data around, while fetching and
preprocessing raise `ImageError(kind="Unsupported")`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._text import describe
from .errors import CalcResizeError, ImageError

__all__ = [
    "ImageInfo",
    "MultiModalData",
    "ImageQuota",
    "PreprocessOptions",
    "ReqwestImageFetcher",
    "OpenCvImagePreprocessor",
    "ImageResolver",
    "ImageTokenSpec",
]

_DETAILS = ("low", "high", "original", "auto")


class ImageInfo:
    """A preprocessed image: encoded bytes and its size in pixels."""

    __slots__ = ("_data", "_width", "_height")

    def __init__(self, data: bytes, width: int, height: int) -> None:
        for name, v in (("width", width), ("height", height)):
            if type(v) is not int or v < 0:
                raise ValueError(f"ImageInfo.{name} must be a non-negative int, got {describe(v)}")
        self._data, self._width, self._height = bytes(data), width, height

    data = property(lambda self: self._data)
    width = property(lambda self: self._width)
    height = property(lambda self: self._height)


class ImageTokenSpec:
    """How many prompt tokens a V4.1 image occupies after resizing to the patch grid.

    V4.1: 14-px patches, 3x3 downsampling, at most 1024 tokens, images upscaled to at
    least 544*544 pixels. A grid of `h x w` cells costs `h * (w + 1) + 2` tokens (a
    row separator per row plus two delimiters). The resize is iterated until it is a
    fixed point (at most 10 rounds).
    """

    __slots__ = ("patch", "downsample", "max_tokens", "min_pixels")

    def __init__(
        self, *, patch: int = 14, downsample: int = 3, max_tokens: int = 1024, min_pixels: int = 544 * 544
    ):
        self.patch, self.downsample, self.max_tokens, self.min_pixels = (
            patch,
            downsample,
            max_tokens,
            min_pixels,
        )

    def _grid(self, best_h: int, best_w: int) -> tuple[int, int, int, int, int]:
        n_h = -(-(best_h // self.patch) // self.downsample)
        n_w = -(-(best_w // self.patch) // self.downsample)
        return (n_h, n_w, best_h, best_w, n_h * (n_w + 1) + 2)

    def _solve(self, height: int, width: int) -> tuple[int, int, int, int, int]:
        unit = self.patch * self.downsample
        ratio = height / width
        max_w_f = ((self.max_tokens - 2) / ratio + 0.25) ** 0.5 - 0.5
        max_h_f = max_w_f * ratio
        if max_w_f < 1.0:
            best_w, best_h = unit, ((self.max_tokens - 2) // 2) * unit
        elif max_h_f < 1.0:
            best_w, best_h = ((self.max_tokens - 2) - 1) * unit, unit
        else:
            max_w, max_h = int(max_w_f), int(max_h_f)
            beta = min(max_w * unit / width, max_h * unit / height)
            best_w = int(width * beta / self.patch) * self.patch
            best_h = int(height * beta / self.patch) * self.patch
        return self._grid(best_h, best_w)

    def _once(self, width: int, height: int) -> tuple[int, int, int, int, int]:
        pixels = width * height
        if 0 < pixels < self.min_pixels:
            r = (self.min_pixels / pixels) ** 0.5
            width, height = int(width * r), int(height * r)
        best_w = -(-width // self.patch) * self.patch
        best_h = -(-height // self.patch) * self.patch
        result = self._grid(best_h, best_w)
        if result[4] > self.max_tokens:
            result = self._solve(height, width)
        return result

    def calc_resize(self, width: int, height: int) -> tuple[int, int, int, int, int]:
        """`(n_llm_h, n_llm_w, best_height, best_width, token_count)`; CalcResizeError if it does not settle."""
        result = self._once(width, height)
        for _ in range(1, 10):
            nxt = self._once(result[3], result[2])
            if nxt == result:
                return result
            result = nxt
        raise CalcResizeError(f"image resize did not converge after 10 iterations, last result: {result}")

    def calc_token_count(self, width: int, height: int) -> int:
        return self.calc_resize(width, height)[4]


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
        """Inference input tokens beyond one placeholder per image (V4.1 image token spec)."""
        spec = ImageTokenSpec()
        return sum(spec.calc_token_count(i.width, i.height) - 1 for i in self._images)


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
            f"fetching {describe(url)}: image fetching is not supported by the pure-Python recipe", kind="Unsupported"
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

"""Image files read exactly as mmdet's and mmseg's pipelines read them.

Every shipped config (and the mmdet / mmseg base configs they inherit) starts its test pipeline
with mmcv's ``LoadImageFromFile`` with its defaults, ``color_type='color'`` and
``imdecode_backend='cv2'``: OpenCV's ``IMREAD_COLOR``, which turns the EXIF orientation upright,
expands grayscale and palette files to three channels, drops an alpha channel (no compositing),
converts CMYK JPEGs and reduces 16-bit files to 8 bits. It gives BGR, and the models' data
preprocessor (``bgr_to_rgb=True``) flips it to RGB before normalising.

:func:`read_rgb` does the same: with mmcv installed it *is* mmcv's reading
(``mmcv.imfrombytes`` with the loader's ``color_type`` and ``imdecode_backend``), so features
extracted from a file are those the detector's backbone sees for it. Without mmcv (an optional
dependency) it falls back to Pillow, applying the same steps: EXIF orientation
(``ImageOps.exif_transpose``), 16-bit values to their high byte, grayscale / palette / CMYK to
RGB, alpha dropped. PNG and other lossless files then give the same pixels as mmcv; JPEGs
can differ by a level or two (two builds of libjpeg), and a truncated JPEG, which OpenCV
decodes with its missing part grey, is refused.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

#: ``read_rgb``'s ``reader`` values: ``auto`` is ``mmcv`` where it is installed, else ``pil``.
READERS = ("auto", "mmcv", "pil")
#: Pillow modes holding more than 8 bits per sample (16-bit PNG / TIFF): scaled to their high byte.
_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
#: What a JPEG ends with; its absence means the file was cut off.
_JPEG_SOI, _JPEG_EOI = b"\xff\xd8", b"\xff\xd9"


class ImageReadError(ValueError):
    """A file that is not an image the reader can decode; the message names the file and why."""


@dataclass(frozen=True)
class LoaderSettings:
    """The decoding settings of a pipeline's ``LoadImageFromFile`` and whether the data
    preprocessor flips BGR to RGB (mmcv's defaults and the shipped configs' values)."""

    color_type: str = "color"
    imdecode_backend: str = "cv2"
    bgr_to_rgb: bool = True


def mmcv_available() -> bool:
    """Whether mmcv (and its image I/O) can be imported."""
    try:
        import mmcv  # noqa: F401

        from mmcv import imfrombytes  # noqa: F401
    except Exception:  # not installed, or built for another torch: the Pillow path
        return False
    return True


def resolve_reader(reader: str = "auto") -> str:
    """``'mmcv'`` or ``'pil'`` for a :data:`READERS` value; ``'mmcv'`` without mmcv is an error."""
    if reader not in READERS:
        raise ValueError(f"reader: expected one of {READERS}, got {reader!r}")
    if reader == "auto":
        return "mmcv" if mmcv_available() else "pil"
    if reader == "mmcv" and not mmcv_available():
        raise ValueError("reader: 'mmcv' asked for, but mmcv cannot be imported (pip install 'swin-backbone[mmdet]')")
    return reader


def _find_loader(pipeline: Any) -> Optional[dict]:
    for step in pipeline or ():
        if isinstance(step, dict) and str(step.get("type", "")).split(".")[-1] == "LoadImageFromFile":
            return step
    return None


def loader_settings(cfg: Any) -> LoaderSettings:
    """The :class:`LoaderSettings` of an mmengine config: its test pipeline's
    ``LoadImageFromFile`` (``test_pipeline``, else ``test_dataloader.dataset.pipeline``) and its
    model's ``data_preprocessor.bgr_to_rgb``; mmcv's defaults where the config sets nothing."""
    pipeline = cfg.get("test_pipeline")
    if _find_loader(pipeline) is None:
        pipeline = ((cfg.get("test_dataloader") or {}).get("dataset") or {}).get("pipeline")
    step = _find_loader(pipeline) or {}
    preprocessor = (cfg.get("model") or {}).get("data_preprocessor") or {}
    return LoaderSettings(
        color_type=step.get("color_type", "color"),
        imdecode_backend=step.get("imdecode_backend", "cv2"),
        bgr_to_rgb=bool(preprocessor.get("bgr_to_rgb", False)) if preprocessor else True,
    )


def _three_channels(image: Any, source: str, reader: str) -> np.ndarray:
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        shape = getattr(image, "shape", None)
        raise ImageReadError(
            f"{source}: {reader} decoded it to {getattr(image, 'dtype', type(image).__name__)} of shape {shape}; "
            "expected 3-channel 8-bit pixels (LoadImageFromFile color_type='color')"
        )
    return image


def decode_mmcv(data: bytes, settings: LoaderSettings = LoaderSettings(), source: str = "<bytes>") -> np.ndarray:
    """``(H, W, 3)`` uint8 as mmcv's ``LoadImageFromFile`` gives it (BGR for ``'color'``)."""
    import mmcv

    try:
        image = mmcv.imfrombytes(data, flag=settings.color_type, backend=settings.imdecode_backend)
    except Exception as err:  # OpenCV / Pillow decoder errors
        raise ImageReadError(f"{source}: mmcv cannot decode it ({type(err).__name__}: {err})") from None
    if image is None:  # OpenCV's answer to anything it cannot decode; LoadImageFromFile asserts on it
        raise ImageReadError(f"{source}: mmcv ({settings.imdecode_backend}) cannot decode it: not an image, "
                             "a format OpenCV does not read, or a damaged file")
    return _three_channels(image, source, f"mmcv ({settings.imdecode_backend})")


def decode_pil(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB with Pillow, converted as OpenCV's ``IMREAD_COLOR`` converts."""
    from PIL import Image, ImageOps

    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()  # decodes now: a truncated or damaged file fails here
            im = ImageOps.exif_transpose(opened) or opened
            if im.mode in _WIDE_MODES:
                grey = np.clip(np.asarray(im).astype(np.int64) >> 8, 0, 255)  # 16-bit: the high byte
                return np.repeat(grey.astype(np.uint8)[:, :, None], 3, axis=2)
            if im.mode == "F":
                grey = np.clip(np.nan_to_num(np.asarray(im)), 0, 255).round().astype(np.uint8)
                return np.repeat(grey[:, :, None], 3, axis=2)
            return _three_channels(np.array(im.convert("RGB")), source, "Pillow")
    except ImageReadError:
        raise
    except Exception as err:  # UnidentifiedImageError, truncated data, decoder errors
        raise ImageReadError(f"{source}: Pillow cannot decode it ({type(err).__name__}: {err})") from None


def jpeg_truncated(data: bytes) -> bool:
    """Whether ``data`` is a JPEG without its end-of-image marker (near its end: some cameras
    append bytes after it), i.e. a file that was cut off."""
    return data[:2] == _JPEG_SOI and _JPEG_EOI not in data[-4096:]


def read_bytes(path: str) -> bytes:
    """The file's bytes; a missing file, a folder or an empty file is an :class:`ImageReadError`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ImageReadError(f"{path}: cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    if not data:
        raise ImageReadError(f"{path}: empty file (0 bytes)")
    return data


def decode_rgb(data: bytes, reader: str = "auto", settings: LoaderSettings = LoaderSettings(),
               source: str = "<bytes>") -> np.ndarray:
    """:func:`read_rgb` of a file's bytes (``source`` names it in errors)."""
    if resolve_reader(reader) == "pil":
        if settings.color_type != "color":
            raise ValueError(f"reader 'pil': reads color_type='color' only (the shipped configs'), got "
                             f"{settings.color_type!r}; install mmcv to read as that pipeline does")
        rgb = decode_pil(data, source=source)
        return rgb if settings.bgr_to_rgb else np.ascontiguousarray(rgb[:, :, ::-1])
    bgr = decode_mmcv(data, settings, source=source)
    return np.ascontiguousarray(bgr[:, :, ::-1]) if settings.bgr_to_rgb else bgr


def read_rgb(path: str, reader: str = "auto", settings: LoaderSettings = LoaderSettings()) -> np.ndarray:
    """The ``(H, W, 3)`` uint8 RGB pixels mmdet's / mmseg's backbone sees for the file at
    ``path`` (before resizing and normalisation): mmcv's ``LoadImageFromFile`` with
    ``settings``, then the data preprocessor's BGR -> RGB flip (``settings.bgr_to_rgb``).

    ``reader``: ``'mmcv'``, ``'pil'`` (the documented fallback) or ``'auto'`` (mmcv where
    installed). Raises :class:`ImageReadError` for a file that cannot be decoded.
    """
    return decode_rgb(read_bytes(path), reader, settings, source=path)

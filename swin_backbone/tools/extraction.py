"""Images in, feature files out: what ``swin-extract-features`` reads and writes
(:mod:`swin_backbone.tools.extract_features` runs the job).

Reading: :func:`read_rgb` gives the pixels mmdet's / mmseg's backbone sees for a file: with mmcv
installed it *is* mmcv's ``LoadImageFromFile`` (``mmcv.imfrombytes`` with the pipeline's
``color_type`` and ``imdecode_backend``) and the data preprocessor's BGR -> RGB flip; without
it, Pillow applies the same conversions (EXIF orientation, 16-bit to the high byte, grayscale /
palette / CMYK to RGB, alpha dropped): docs/robustness.md. Writing: one image's files, each
written whole, the check that a rerun can skip an image whose files are complete, and
``--pool avg``'s per-rank shards.
"""
from __future__ import annotations

import glob
import io
import os
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..checkpoint.files import atomic_write
from ..features import pca_rgb, resize_to, side_by_side
from ..torch_compat import load_supports_mmap

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


# -------------------------------------------------------------------- the images of INPUT
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")


def inside(path: str, folder: Optional[str]) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (resolved: links, ``..``, case as stored)."""
    if not folder:
        return False
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def find_images(spec: str, exclude: Optional[str] = None) -> Tuple[List[str], str]:
    """Image paths (sorted) for a file, folder or glob, and the root their output paths are
    relative to. Nothing under ``exclude`` (the output folder) counts as an input: a second
    run into ``IN/feats`` must not read its own ``--png`` visualisations as images."""
    if os.path.isdir(spec):
        paths = []
        for folder, subdirs, files in os.walk(spec):
            subdirs[:] = sorted(d for d in subdirs if not inside(os.path.join(folder, d), exclude))
            paths += [os.path.join(folder, f) for f in files if f.lower().endswith(IMAGE_EXTS)]
        return sorted(paths), spec
    if os.path.isfile(spec):
        return [spec], os.path.dirname(spec) or "."
    paths = sorted(p for p in glob.glob(spec, recursive=True)
                   if os.path.isfile(p) and p.lower().endswith(IMAGE_EXTS) and not inside(p, exclude))
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else "."
    return paths, root


def output_names(paths: Sequence[str], root: str) -> Dict[str, str]:
    """Each image's output name (relative to OUT_DIR, without suffix): its relative path
    without the extension, or with it where two images would share a name (``x0.jpg`` and
    ``x0.png`` -> ``x0.jpg`` and ``x0.png``, never one ``x0.npz`` for both). Names are compared
    case-insensitively (macOS and Windows folders). Raises ``ValueError`` if names still collide."""
    rel = {p: os.path.relpath(p, root) for p in paths}
    stems = {p: os.path.splitext(r)[0] for p, r in rel.items()}
    count = Counter(stem.lower() for stem in stems.values())
    names = {p: stems[p] if count[stems[p].lower()] == 1 else rel[p] for p in paths}
    seen: Dict[str, str] = {}
    for p, name in names.items():
        other = seen.setdefault(name.lower(), p)
        if other != p:
            raise ValueError(f"input: {other!r} and {p!r} would write the same outputs ({name}.*) in OUT_DIR; "
                             "rename one of them")
    return names


# --------------------------------------------------------- decoding in DataLoader workers
def as_is(item: Any) -> Any:
    """DataLoader collate for ``batch_size=None``: samples unchanged (batches form by size later)."""
    return item


class ImageJobs(Dataset):
    """One rank's images, for DataLoader workers: each item is ``done`` (outputs already
    complete, with their index rows), ``failed`` (unreadable, with the error) or ``ok`` with the
    decoded ``(3, H, W)`` image (uint8; float32 if resized) and, for PNGs, the RGB image shown."""

    def __init__(self, paths: Sequence[str], plan: OutputPlan, resize: Optional[Tuple[int, int]],
                 skip_complete: bool, pooled: Optional[Set[str]], reader: str = "auto",
                 loader: LoaderSettings = LoaderSettings()) -> None:
        self.paths, self.plan, self.resize = list(paths), plan, resize
        self.skip_complete, self.pooled = skip_complete, pooled  # pooled: images whose vector exists
        self.reader, self.loader = resolve_reader(reader), loader

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        path = self.paths[i]
        if self.skip_complete and (self.pooled is None or self.plan.key(path) in self.pooled):
            rows = self.plan.complete_rows(path)
            if rows is not None:
                return dict(i=i, status="done", rows=rows)
        try:
            data = read_bytes(path)
            rgb = decode_rgb(data, self.reader, self.loader, source=path)
        except Exception as err:  # not an image, damaged, refused by mmcv: reported and skipped
            error = str(err) if isinstance(err, ImageReadError) else f"{path}: {type(err).__name__}: {err}"
            return dict(i=i, status="failed", error=error)
        # mmcv (OpenCV) decodes a JPEG that was cut off with its missing part grey, as the
        # detector would see it: extracted, but said.
        note = (f"{path}: JPEG without its end-of-image marker (cut off?); read as mmcv reads it, the missing "
                "part grey" if self.reader == "mmcv" and jpeg_truncated(data) else None)
        image = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
        shown = rgb if self.plan.png else None
        if self.resize is not None:
            image = resize_to(image.float(), self.resize)
            shown = None if shown is None else np.asarray(Image.fromarray(rgb).resize(tuple(self.resize[::-1])))
        return dict(i=i, status="ok", image=image, shown=shown, note=note)


def default_workers(local_world_size: int = 1, device: str = "cuda") -> int:
    """Decoding workers per rank. CUDA: the rank's share of the node's cores minus one for
    the rank itself, 1..8. CPU: the forward already uses every core and a decoding process
    stalls it, so 1 worker only from 4 cores per rank on, else 0 (decode inline)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    share = cores // max(1, local_world_size)
    if torch.device(device).type == "cuda":
        return max(1, min(8, share - 1))
    return 1 if share >= 4 else 0


# ---------------------------------------------------------------------- one image's files
def _npy_header(f) -> Tuple[Tuple[int, ...], np.dtype, int]:
    """Shape, dtype and data offset of the ``.npy`` stream ``f`` (header only, no data read)."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    return tuple(shape), dtype, f.tell()


@dataclass
class OutputPlan:
    """Which files one image gets, how to write them, and how to tell that they are complete."""

    out_dir: str
    root: str
    fmt: str
    channels: Dict[int, int]  # stage -> channels, from a probe forward
    maps: bool = True
    png: bool = False
    names: Dict[str, str] = field(default_factory=dict)  # path -> output name (output_names)

    def key(self, path: str) -> str:
        """The image's path relative to the input root, ``/``-separated (its identity on disk)."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def base(self, path: str) -> str:
        return os.path.join(self.out_dir, self.names.get(path) or os.path.splitext(os.path.relpath(path, self.root))[0])

    def files(self, path: str) -> Dict[str, List[int]]:
        """``{file: stages}`` of the image's feature maps."""
        if not self.maps:
            return {}
        if self.fmt == "npz":
            return {self.base(path) + ".npz": list(self.channels)}
        return {f"{self.base(path)}.stage{s}.{self.fmt}": [s] for s in self.channels}

    def _row(self, path: str, stage: int, shape: Sequence[int], file: str) -> dict:
        return dict(image=path, stage=stage, shape=list(shape), dtype="float32", key=f"stage{stage}" if
                    self.fmt == "npz" else "", file=os.path.relpath(file, self.out_dir).replace(os.sep, "/"))

    def write(self, path: str, feat: Dict[int, torch.Tensor], shown: Optional[np.ndarray]) -> List[dict]:
        """Write one image's feature files (and PNGs), each whole or not at all; its index rows."""
        rows = []
        for file, stages in self.files(path).items():
            buf = io.BytesIO()
            if self.fmt == "npz":
                np.savez(buf, **{f"stage{s}": feat[s].numpy() for s in stages})
            elif self.fmt == "npy":
                np.save(buf, feat[stages[0]].numpy())
            else:
                torch.save(feat[stages[0]].clone(), buf)
            atomic_write(file, buf.getvalue())
            rows += [self._row(path, s, feat[s].shape, file) for s in stages]
        for s, f in feat.items() if self.png else ():
            buf = io.BytesIO()
            Image.fromarray(side_by_side(shown, [pca_rgb(f)])).save(buf, format="PNG")
            atomic_write(f"{self.base(path)}.stage{s}.png", buf.getvalue())
        return rows

    def stored(self, file: str, stages: List[int]) -> Dict[int, Tuple[Tuple[int, ...], Any]]:
        """``{stage: (shape, dtype)}`` of a written file, from its headers; an error if it is cut off."""
        if self.fmt == "pt":
            t = torch.load(file, map_location="cpu", weights_only=True, **(dict(mmap=True) if load_supports_mmap()
                                                                          else {}))
            return {stages[0]: (tuple(t.shape), t.dtype)}
        if self.fmt == "npy":
            a = np.load(file, mmap_mode="r")  # (a file shorter than its header says cannot be mapped)
            return {stages[0]: (a.shape, a.dtype)}
        out = {}
        with zipfile.ZipFile(file) as z:
            for s in stages:
                info = z.getinfo(f"stage{s}.npy")
                with z.open(info) as f:
                    shape, dtype, offset = _npy_header(f)
                if info.file_size != offset + dtype.itemsize * int(np.prod(shape)):
                    raise ValueError(f"{file}: stage{s}.npy is cut off")
                out[s] = (shape, dtype)
        return out

    def complete_rows(self, path: str) -> Optional[List[dict]]:
        """The index rows of ``path``'s outputs if every one of them is on disk and complete
        (right stages, channels and dtype, as long as its header says, PNGs verified); ``None``
        if anything is missing, cut off or different."""
        rows = []
        try:
            for file, stages in self.files(path).items():
                for s, (shape, dtype) in self.stored(file, stages).items():
                    if len(shape) != 3 or shape[0] != self.channels[s] or dtype not in (np.float32, torch.float32):
                        return None
                    rows.append(self._row(path, s, shape, file))
            for s in self.channels if self.png else ():
                with Image.open(f"{self.base(path)}.stage{s}.png") as im:
                    im.verify()
        except Exception:  # missing, truncated or corrupt: redo the image
            return None
        return rows


# ----------------------------------------------------------------------------- --pool avg
POOL_DIR = "pooled"
#: New pooled vectors a rank keeps in memory before writing them to a partial file (resume point).
POOL_FLUSH = 1024
POOL_FILES = ("shard-", "partial-")


class PooledStore:
    """Mean-pooled vectors of one rank: ``pooled/shard-RRRRR-of-WWWWW.npz`` with ``images``
    (paths relative to INPUT) and ``stage{i}`` ``(N, C_i)`` float32 arrays, one row per image.

    Every :data:`POOL_FLUSH` new vectors also go to a ``partial-...npz`` file, so that an
    interrupted run keeps them; a rerun reads every ``.npz`` it finds there (any world size),
    and rank 0 deletes all but the current shards once every rank is done.
    """

    def __init__(self, out_dir: str, rank: int, world_size: int, channels: Dict[int, int]) -> None:
        self.dir, self.channels = os.path.join(out_dir, POOL_DIR), channels
        self.tag = f"{rank:05d}-of-{world_size:05d}"
        self.vectors: Dict[str, Dict[int, np.ndarray]] = {}
        self.unflushed: List[str] = []
        self.run_id = f"{os.getpid()}.{time.time_ns()}"

    def load_existing(self, wanted: Set[str]) -> Set[str]:
        """Read the vectors of ``wanted`` images from every valid pooled file on disk; the images found."""
        for name in sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []:
            if not name.startswith(POOL_FILES) or not name.endswith(".npz"):
                continue
            try:
                with np.load(os.path.join(self.dir, name), allow_pickle=False) as z:
                    images, arrays = z["images"], {s: z[f"stage{s}"] for s in self.channels}
            except Exception:  # cut off or foreign: its images are simply redone
                continue
            if images.ndim == 1 and all(a.shape == (len(images), self.channels[s]) and a.dtype == np.float32
                                        for s, a in arrays.items()):
                for j, image in enumerate(images.tolist()):
                    if image in wanted:
                        self.vectors[image] = {s: a[j] for s, a in arrays.items()}
        return set(self.vectors)

    def add(self, image: str, vectors: Dict[int, torch.Tensor]) -> None:
        self.vectors[image] = {s: v.numpy() for s, v in vectors.items()}
        self.unflushed.append(image)
        if len(self.unflushed) >= POOL_FLUSH:
            self.save(f"partial-{self.tag}-{self.run_id}.{len(self.vectors)}.npz", self.unflushed)
            self.unflushed = []

    def save(self, name: str, images: Sequence[str]) -> str:
        """Write the vectors of ``images`` to ``pooled/name``; its path."""
        buf = io.BytesIO()
        np.savez(buf, images=np.array(list(images), dtype=str), **{
            f"stage{s}": np.stack([self.vectors[i][s] for i in images]) if images else np.zeros((0, c), np.float32)
            for s, c in self.channels.items()})
        atomic_write(os.path.join(self.dir, name), buf.getvalue())
        return os.path.join(self.dir, name)

    def write_shard(self, images: Sequence[str]) -> str:
        """The rank's shard: the vectors of ``images`` (done ones, in the rank's order)."""
        return self.save(f"shard-{self.tag}.npz", images)

    @staticmethod
    def remove_stale(out_dir: str, world_size: int) -> None:
        """Rank 0, after every rank wrote its shard: delete partial files and other runs' shards."""
        pool_dir = os.path.join(out_dir, POOL_DIR)
        current = {f"shard-{r:05d}-of-{world_size:05d}.npz" for r in range(world_size)}
        for name in os.listdir(pool_dir) if os.path.isdir(pool_dir) else []:
            if name.startswith(POOL_FILES) and name.endswith(".npz") and name not in current:
                os.remove(os.path.join(pool_dir, name))

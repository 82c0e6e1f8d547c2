"""Images in, feature files out, for ``swin-extract-features`` (:mod:`.extract_features` runs the job): reading
a file as mmdet / mmseg do (:func:`read_rgb`), INPUT's images, decoding in DataLoader workers, each image's files
and ``--pool avg``'s."""
from __future__ import annotations

import glob
import io
import os
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from ..checkpoint.files import atomic_path
from ..features import pca_rgb, resize_to, side_by_side
from ..torch_compat import load_supports_mmap

READERS = ("auto", "mmcv", "pil")  # auto: mmcv where it can be imported, else pil
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")


class ImageReadError(ValueError):
    """A file the reader cannot decode; the message names the file and why."""


@dataclass(frozen=True)
class LoaderSettings:
    """A pipeline's ``LoadImageFromFile`` settings and its data preprocessor's BGR -> RGB flip (defaults: mmcv's)."""

    color_type: str = "color"
    imdecode_backend: str = "cv2"
    bgr_to_rgb: bool = True


def loader_settings(cfg: Any) -> LoaderSettings:
    """An mmengine config's: its ``test_pipeline``'s (else ``test_dataloader``'s) ``LoadImageFromFile``."""
    pipelines = (cfg.get("test_pipeline"), ((cfg.get("test_dataloader") or {}).get("dataset") or {}).get("pipeline"))
    step = next((s for pipeline in pipelines for s in pipeline or () if isinstance(s, dict)
                 and str(s.get("type", "")).split(".")[-1] == "LoadImageFromFile"), {})
    preprocessor = (cfg.get("model") or {}).get("data_preprocessor") or {}
    return LoaderSettings(**{k: step[k] for k in ("color_type", "imdecode_backend") if k in step},
                          bgr_to_rgb=bool(preprocessor.get("bgr_to_rgb", False)) if preprocessor else True)


def resolve_reader(reader: str = "auto") -> str:
    """``'mmcv'`` or ``'pil'`` for a :data:`READERS` value; ``'mmcv'`` without mmcv is an error."""
    if reader not in READERS:
        raise ValueError(f"reader: expected one of {READERS}, got {reader!r}")
    if reader != "pil":
        try:
            import mmcv  # noqa: F401

            return "mmcv"
        except Exception:  # not installed, or built for another torch
            if reader == "mmcv":
                raise ValueError("reader: 'mmcv' asked for, but mmcv cannot be imported "
                                 "(pip install 'swin-backbone[mmdet]')") from None
    return "pil"


def decode_pil(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB with Pillow, converted as OpenCV's ``IMREAD_COLOR`` converts."""
    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()  # decodes now: a truncated or damaged file fails here
            im = ImageOps.exif_transpose(opened) or opened
            if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):  # 16-bit PNG / TIFF: the high byte
                grey = np.asarray(im).astype(np.int64) >> 8
            elif im.mode == "F":
                grey = np.nan_to_num(np.asarray(im)).round()
            else:
                return np.array(im.convert("RGB"))
            return np.repeat(np.clip(grey, 0, 255).astype(np.uint8)[:, :, None], 3, axis=2)
    except Exception as err:  # UnidentifiedImageError, truncated data, decoder errors
        raise ImageReadError(f"{source}: Pillow cannot decode it ({type(err).__name__}: {err})") from None


def read_bytes(path: str) -> bytes:
    """The file's bytes; a missing file, a folder or an empty file is an :class:`ImageReadError`."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ImageReadError(f"{path}: cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    if not data:
        raise ImageReadError(f"{path}: empty file (0 bytes)")
    return data


def read_rgb(path: str, reader: str = "auto", settings: LoaderSettings = LoaderSettings(),
             data: Optional[bytes] = None) -> np.ndarray:
    """The ``(H, W, 3)`` uint8 RGB pixels mmdet's / mmseg's backbone sees for the file at ``path`` (or for its
    bytes ``data``), before resizing and normalisation, read with ``reader`` (:data:`READERS`): with mmcv it *is*
    ``LoadImageFromFile`` (``mmcv.imfrombytes`` with the pipeline's ``color_type`` and ``imdecode_backend``) and
    the data preprocessor's BGR -> RGB flip; with Pillow, the same conversions (EXIF orientation, 16-bit to the
    high byte, grayscale / palette / CMYK to RGB, alpha dropped: docs/robustness.md). A file that cannot be read
    or decoded is an :class:`ImageReadError`."""
    data = read_bytes(path) if data is None else data
    if resolve_reader(reader) == "pil":
        if settings.color_type != "color":
            raise ValueError(f"reader 'pil': reads color_type='color' only (the shipped configs'), got "
                             f"{settings.color_type!r}; install mmcv to read as that pipeline does")
        rgb = decode_pil(data, source=path)
        return rgb if settings.bgr_to_rgb else np.ascontiguousarray(rgb[:, :, ::-1])
    import mmcv

    backend = f"mmcv ({settings.imdecode_backend})"
    try:
        image = mmcv.imfrombytes(data, flag=settings.color_type, backend=settings.imdecode_backend)
    except Exception as err:  # OpenCV / Pillow decoder errors
        raise ImageReadError(f"{path}: {backend} cannot decode it ({type(err).__name__}: {err})") from None
    if image is None:  # OpenCV's answer to anything it cannot decode
        raise ImageReadError(f"{path}: {backend} cannot decode it: not an image, a format OpenCV does not read, "
                             "or a damaged file")
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:  # another color_type
        raise ImageReadError(f"{path}: {backend} decoded it to {image.dtype} of shape {image.shape}; expected "
                             "3-channel 8-bit pixels (LoadImageFromFile color_type='color')")
    # the data preprocessor's flip, not imfrombytes' channel_order: that one is ignored by some backends
    return np.ascontiguousarray(image[:, :, ::-1]) if settings.bgr_to_rgb else image


# -------------------------------------------------------------------- the images of INPUT
def inside(path: str, folder: Optional[str]) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (links and ``..`` resolved)."""
    real = Path(os.path.realpath(path))
    return bool(folder) and Path(os.path.realpath(folder)) in (real, *real.parents)


def find_images(spec: str, exclude: Optional[str] = None) -> Tuple[List[str], str]:
    """Image paths (sorted) for a file, folder or glob, and the root their outputs are relative to.
    Nothing under ``exclude`` (OUT_DIR) is an input: a rerun must not read its own ``--png`` files."""
    if os.path.isdir(spec):
        paths = []
        for folder, subdirs, files in os.walk(spec):
            subdirs[:] = [d for d in subdirs if not inside(os.path.join(folder, d), exclude)]
            paths += [os.path.join(folder, f) for f in files if f.lower().endswith(IMAGE_EXTS)]
        return sorted(paths), spec
    if os.path.isfile(spec):
        return [spec], os.path.dirname(spec) or "."
    paths = sorted(p for p in glob.glob(spec, recursive=True)
                   if os.path.isfile(p) and p.lower().endswith(IMAGE_EXTS) and not inside(p, exclude))
    return paths, os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else "."


def output_names(paths: Sequence[str], root: str) -> Dict[str, str]:
    """Each image's output name: its relative path without the extension, or with it where two would share
    one (``x0.jpg``, ``x0.png``), compared case-insensitively (macOS, Windows); a clash left is a ``ValueError``."""
    stems = {p: os.path.splitext(os.path.relpath(p, root)) for p in paths}  # path -> (stem, extension)
    count = Counter(stem.lower() for stem, _ in stems.values())
    names = {p: stem if count[stem.lower()] == 1 else stem + ext for p, (stem, ext) in stems.items()}
    seen: Dict[str, str] = {}
    for p, name in names.items():
        if seen.setdefault(name.lower(), p) != p:
            raise ValueError(f"input: {seen[name.lower()]!r} and {p!r} would write the same outputs ({name}.*) in "
                             "OUT_DIR; rename one of them")
    return names


# --------------------------------------------------------- decoding in DataLoader workers
def as_is(item: Any) -> Any:
    """DataLoader ``collate_fn``: the item as it is (the default one turns numpy arrays into tensors)."""
    return item


class ImageJobs(Dataset):
    """One rank's images, for DataLoader workers: each item is ``done`` (outputs complete: their index
    ``rows``), ``failed`` (its ``error``) or ``ok``: the decoded ``(3, H, W)`` RGB ``image`` (uint8; float32 if
    resized) and a ``note`` (or ``None``)."""

    def __init__(self, paths: Sequence[str], plan: OutputPlan, resize: Optional[Tuple[int, int]],
                 skip_complete: bool, pooled: Optional[Set[str]], reader: str = "auto",
                 loader: LoaderSettings = LoaderSettings()) -> None:
        self.paths, self.plan, self.resize = list(paths), plan, resize
        self.skip_complete, self.pooled = skip_complete, pooled  # pooled: the images whose vector exists
        self.reader, self.loader = resolve_reader(reader), loader

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        path = self.paths[i]
        if (self.skip_complete and (self.pooled is None or self.plan.key(path) in self.pooled)
                and (rows := self.plan.complete_rows(path)) is not None):
            return dict(i=i, status="done", rows=rows)
        try:
            data = read_bytes(path)
            rgb = read_rgb(path, self.reader, self.loader, data)
        except Exception as err:  # not an image, damaged, refused by mmcv: reported and skipped
            error = str(err) if isinstance(err, ImageReadError) else f"{path}: {type(err).__name__}: {err}"
            return dict(i=i, status="failed", error=error)
        # OpenCV decodes a JPEG without its end marker (cut off) with the missing part grey, as
        # the detector sees it: extracted, but said (cameras may append bytes after the marker)
        cut_off = self.reader == "mmcv" and data[:2] == b"\xff\xd8" and b"\xff\xd9" not in data[-4096:]
        note = (f"{path}: JPEG without its end-of-image marker (cut off?); read as mmcv reads it, the missing "
                "part grey") if cut_off else None
        image = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
        if self.resize is not None:
            image = resize_to(image.float(), self.resize)
        return dict(i=i, status="ok", image=image, note=note)


def default_workers(local_world_size: int = 1, device: str = "cuda") -> int:
    """Decoding workers per rank. CUDA: the rank's share of the cores minus its own, 1..8. CPU: the forward
    uses every core and a decoding process stalls it: 1 from 4 cores per rank on, else 0 (the main process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = cores // max(1, local_world_size)
    if torch.device(device).type == "cuda":
        return max(1, min(8, share - 1))
    return 1 if share >= 4 else 0


# ---------------------------------------------------------------------- one image's files
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
        """Its path relative to the input root, ``/``-separated (its name in pooled files)."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def base(self, path: str) -> str:
        return os.path.join(self.out_dir, self.names.get(path) or os.path.splitext(self.key(path))[0])

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

    def write(self, path: str, feat: Dict[int, torch.Tensor], image: torch.Tensor) -> List[dict]:
        """Write one image's feature files (and PNGs of ``image``, ``(3, H, W)`` as the backbone got it), each whole
        or not at all; its index rows."""
        rows = []
        for file, stages in self.files(path).items():
            with atomic_path(file) as tmp, open(tmp, "wb") as out:
                if self.fmt == "npz":
                    np.savez(out, **{f"stage{s}": feat[s].numpy() for s in stages})
                elif self.fmt == "npy":
                    np.save(out, feat[stages[0]].numpy())
                else:
                    torch.save(feat[stages[0]].clone(), out)  # (a view would save its whole storage)
            rows += [self._row(path, s, feat[s].shape, file) for s in stages]
        if self.png:
            shown = image.float().round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
            for s, f in feat.items():
                with atomic_path(f"{self.base(path)}.stage{s}.png") as tmp:
                    Image.fromarray(side_by_side(shown, [pca_rgb(f)])).save(tmp, format="PNG")
        return rows

    def stored(self, file: str, stages: List[int]) -> Dict[int, Tuple[Tuple[int, ...], Any]]:
        """``{stage: (shape, dtype)}`` of a written file, from its headers (the data is not read); an error if it
        is cut off."""
        if self.fmt == "pt":
            mapped = {"mmap": True} if load_supports_mmap() else {}
            t = torch.load(file, map_location="cpu", weights_only=True, **mapped)
            return {stages[0]: (tuple(t.shape), t.dtype)}
        if self.fmt == "npy":
            a = np.load(file, mmap_mode="r")  # (a file shorter than its header says cannot be mapped)
            return {stages[0]: (a.shape, a.dtype)}
        out, npy = {}, np.lib.format
        with zipfile.ZipFile(file) as z:  # (a cut-off zip has lost its directory: an error)
            for s in stages:
                with z.open(f"stage{s}.npy") as f:  # its header only
                    v1 = npy.read_magic(f) == (1, 0)
                    shape, _, dtype = (npy.read_array_header_1_0 if v1 else npy.read_array_header_2_0)(f)
                out[s] = (tuple(shape), dtype)
        return out

    def complete_rows(self, path: str) -> Optional[List[dict]]:
        """The index rows of ``path``'s outputs if all are complete (stages, channels, dtype, as long as their
        headers say; PNGs verified); ``None`` if anything is missing, cut off or different."""
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
class PooledStore:
    """One rank's mean-pooled vectors: ``pooled/shard-RRRRR-of-WWWWW.npz`` with ``images`` (:meth:`OutputPlan.key`)
    and ``stage{i}`` ``(N, C_i)`` float32 arrays. Every :attr:`FLUSH` new vectors, and when the rank stops, also
    go to a ``partial-*.npz``: a rerun reads every pooled file there (of any world size)."""

    FLUSH = 1024

    def __init__(self, out_dir: str, rank: int, world_size: int, channels: Dict[int, int]) -> None:
        self.dir, self.channels = os.path.join(out_dir, "pooled"), channels
        self.tag, self.run_id = f"{rank:05d}-of-{world_size:05d}", f"{os.getpid()}.{time.time_ns()}"
        self.vectors: Dict[str, Dict[int, np.ndarray]] = {}
        self.unflushed: List[str] = []

    def load_existing(self, wanted: Set[str]) -> Set[str]:
        """Read the vectors of ``wanted`` images from every valid pooled file (shards and partial files, of any
        world size); the images found."""
        for file in sorted([*Path(self.dir).glob("partial-*.npz"), *Path(self.dir).glob("shard-*.npz")]):
            try:
                with np.load(file, allow_pickle=False) as z:
                    images, arrays = z["images"], {s: z[f"stage{s}"] for s in self.channels}
            except Exception:  # cut off or foreign: its images are redone
                continue
            if images.ndim == 1 and all(a.shape == (len(images), self.channels[s]) and a.dtype == np.float32
                                        for s, a in arrays.items()):
                self.vectors.update({image: {s: a[j] for s, a in arrays.items()}
                                     for j, image in enumerate(images.tolist()) if image in wanted})
        return set(self.vectors)

    def add(self, image: str, vectors: Dict[int, torch.Tensor]) -> None:
        self.vectors[image] = {s: v.numpy() for s, v in vectors.items()}
        self.unflushed.append(image)
        if len(self.unflushed) >= self.FLUSH:
            self.flush(f".{len(self.vectors)}")

    def flush(self, suffix: str = ".end") -> None:
        """Write the vectors not yet in a file to ``partial-<tag>-<run><suffix>.npz``."""
        if self.unflushed:
            self.save(f"partial-{self.tag}-{self.run_id}{suffix}.npz", self.unflushed)
            self.unflushed = []

    def save(self, name: str, images: Sequence[str]) -> str:
        """Write the vectors of ``images`` to ``pooled/name``; its path relative to OUT_DIR."""
        with atomic_path(os.path.join(self.dir, name)) as tmp, open(tmp, "wb") as f:
            np.savez(f, images=np.array(list(images), dtype=str), **{
                f"stage{s}": np.stack([self.vectors[i][s] for i in images]) if images else np.zeros((0, c), np.float32)
                for s, c in self.channels.items()})
        return f"pooled/{name}"

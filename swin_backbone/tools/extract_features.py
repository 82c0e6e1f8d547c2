"""Turn images into multi-scale Swin feature maps, from a folder of ten to a whole dataset.

    swin-extract-features INPUT OUT_DIR --arch tiny --checkpoint swin_t.pth
    swin-extract-features INPUT OUT_DIR --arch v2-tiny --checkpoint swinv2_tiny_patch4_window8_256.pth
    python -m swin_backbone.tools.extract_features 'photos/*.jpg' feats --config configs/mmdet/X.py --checkpoint det.pth
    torchrun --nproc-per-node 8 -m swin_backbone.tools.extract_features coco/train2017 feats --checkpoint swin_t.pth --device cuda --pool avg

``--arch`` names a Swin V1 preset (tiny, small, base, large; window 7), a Swin V2 preset
(v2-tiny ... v2-giant; window 8) or a published Swin V2 model (swinv2_tiny_window8_256, ...:
its window and pre-training windows); ``--checkpoint`` may be in any format of that version
(detected from its keys: official, timm, torchvision, mmdet / mmpretrain, ours).

INPUT is an image file, a folder (searched recursively) or a glob. For each image, OUT_DIR
gets, at the image's relative path: ``NAME.npz`` (all stages) or ``NAME.stage{i}.npy|.pt``,
and with ``--png`` a ``NAME.stage{i}.png`` per stage (the image beside the first three
principal components of the features as RGB). ``--pool avg`` also writes one mean-pooled
vector per image and stage into ``pooled/shard-RRRRR-of-WWWWW.npz`` (one file per rank, with
its image list); ``--no-maps`` then skips the per-image maps. ``index.json`` and ``index.csv``
list image, stage, shape, dtype and file.

Images are decoded (and resized) in DataLoader worker processes (``--workers``); a batch
holds images of one input size. A rerun skips images whose outputs are complete (each file
is checked: a file cut off by a crash is redone), ``--overwrite`` redoes everything, and the
index is rebuilt from what is on disk. Under torchrun each rank takes a disjoint share of
the sorted image list (``paths[rank::world_size]``), one GPU per rank with ``--device cuda``;
rank 0 writes the index once every rank has finished. Unreadable images are reported (once)
and skipped. Every file is written to a temporary name and renamed. Nothing is downloaded.

Without ``--checkpoint`` the backbone would have random weights and the features would
mean nothing: that takes ``--random-weights`` (and is flagged in ``index.json``).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import glob
import hashlib
import io
import json
import math
import os
import re
import signal
import sys
import time
import traceback
import zipfile
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from ..checkpoint.remote import fetch, is_reference, resolve
from ..torch_compat import load_supports_mmap
from .job import in_job, leave_job
from ..images import READERS, ImageReadError, LoaderSettings, decode_rgb, jpeg_truncated, read_bytes, resolve_reader
from ..features import (DTYPES, IMAGENET_MEAN, IMAGENET_STD, FeatureExtractor, arch_names, default_window_size,
                        mean_pool, pca_rgb, resize_to, side_by_side, split_arch)

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")
POOL_DIR = "pooled"
RANKS_DIR = "ranks"
SETTINGS_FILE = "settings.json"
#: New pooled vectors a rank keeps in memory before writing them to a partial file (resume point).
POOL_FLUSH = 1024
#: How long a rank that saw another rank die waits before failing itself (torchrun names the
#: first process to exit as the root cause).
PEER_FAILURE_GRACE_S = 5.0
POOL_FILE = re.compile(r"^(shard|partial)-(\d{5})-of-(\d{5})(-[A-Za-z0-9_.]+)?\.npz$")
RANDOM_WEIGHTS_WARNING = ("RANDOM WEIGHTS: no --checkpoint was given (--random-weights), so these features come "
                          "from an untrained backbone and mean nothing for retrieval, probing or visualisation")
INDEX_FIELDS = ["image", "stage", "shape", "dtype", "file", "key"]


# ---------------------------------------------------------------------------------- files
def _inside(path: str, folder: Optional[str]) -> bool:
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
            subdirs[:] = sorted(d for d in subdirs if not _inside(os.path.join(folder, d), exclude))
            paths += [os.path.join(folder, f) for f in files if f.lower().endswith(IMAGE_EXTS)]
        return sorted(paths), spec
    if os.path.isfile(spec):
        return [spec], os.path.dirname(spec) or "."
    paths = sorted(p for p in glob.glob(spec, recursive=True)
                   if os.path.isfile(p) and p.lower().endswith(IMAGE_EXTS) and not _inside(p, exclude))
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else "."
    return paths, root


def output_names(paths: Sequence[str], root: str) -> Dict[str, str]:
    """Each image's output name (relative to OUT_DIR, without suffix): its relative path
    without the extension, or with it where two images would share a name (``x0.jpg`` and
    ``x0.png`` -> ``x0.jpg`` and ``x0.png``, never one ``x0.npz`` for both). Names are compared
    case-insensitively (macOS and Windows folders). Raises ``ValueError`` if names still collide."""
    rel = {p: os.path.relpath(p, root) for p in paths}
    stems = {p: os.path.splitext(r)[0] for p, r in rel.items()}
    count: Dict[str, int] = {}
    for stem in stems.values():
        count[stem.lower()] = count.get(stem.lower(), 0) + 1
    names = {p: stems[p] if count[stems[p].lower()] == 1 else rel[p] for p in paths}
    seen: Dict[str, str] = {}
    for p, name in names.items():
        other = seen.setdefault(name.lower(), p)
        if other != p:
            raise ValueError(f"input: {other!r} and {p!r} would write the same outputs ({name}.*) in OUT_DIR; "
                             "rename one of them")
    return names


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, then rename it into place."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def serialise(features: Dict[int, torch.Tensor], fmt: str) -> Dict[str, bytes]:
    """``{suffix: bytes}`` for one image's features in ``fmt`` (npz, npy or pt)."""
    if fmt == "npz":
        buf = io.BytesIO()
        np.savez(buf, **{f"stage{s}": f.numpy() for s, f in features.items()})
        return {".npz": buf.getvalue()}
    out = {}
    for s, f in features.items():
        buf = io.BytesIO()
        if fmt == "npy":
            np.save(buf, f.numpy())
        else:
            torch.save(f.clone(), buf)
        out[f".stage{s}.{fmt}"] = buf.getvalue()
    return out


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


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

    names: Optional[Dict[str, str]] = None  # path -> output name (output_names); None: the stem

    def key(self, path: str) -> str:
        """The image's path relative to the input root, ``/``-separated (its identity on disk)."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def base(self, path: str) -> str:
        name = self.names.get(path) if self.names else None
        return os.path.join(self.out_dir, name or os.path.splitext(os.path.relpath(path, self.root))[0])

    def _row(self, path: str, stage: int, shape: Sequence[int], file: str, key: str) -> dict:
        return dict(image=path, stage=stage, shape=list(shape), dtype="float32",
                    file=os.path.relpath(file, self.out_dir).replace(os.sep, "/"), key=key)

    def write(self, path: str, feat: Dict[int, torch.Tensor], shown: Optional[np.ndarray]) -> List[dict]:
        """Write one image's feature files (and PNGs); its index rows."""
        base, rows = self.base(path), []
        if self.maps:
            for suffix, data in serialise(feat, self.fmt).items():
                atomic_write(base + suffix, data)
                for s, f in feat.items():
                    if suffix == ".npz" or suffix.startswith(f".stage{s}."):
                        rows.append(self._row(path, s, f.shape, base + suffix, f"stage{s}" if suffix == ".npz" else ""))
        if self.png:
            for s, f in feat.items():
                atomic_write(f"{base}.stage{s}.png", png_bytes(side_by_side(shown, [pca_rgb(f)])))
        return rows

    def complete_rows(self, path: str) -> Optional[List[dict]]:
        """The index rows of ``path``'s outputs if every one of them is on disk and complete
        (right stages, channels and dtype, file as long as its header says, PNGs verified);
        ``None`` if anything is missing, cut off or different."""
        base, rows = self.base(path), []
        try:
            if self.maps and self.fmt == "npz":
                with zipfile.ZipFile(base + ".npz") as z:
                    if sorted(z.namelist()) != sorted(f"stage{s}.npy" for s in self.channels):
                        return None
                    for s in self.channels:
                        info = z.getinfo(f"stage{s}.npy")
                        with z.open(info) as f:
                            shape, dtype, offset = _npy_header(f)
                        if not self._ok(s, shape, dtype) or info.file_size != offset + int(np.prod(shape)) * 4:
                            return None
                        rows.append(self._row(path, s, shape, base + ".npz", f"stage{s}"))
            elif self.maps:
                for s in self.channels:
                    file = f"{base}.stage{s}.{self.fmt}"
                    if self.fmt == "npy":
                        with open(file, "rb") as f:
                            shape, dtype, offset = _npy_header(f)
                        if not self._ok(s, shape, dtype) or os.path.getsize(file) != offset + int(np.prod(shape)) * 4:
                            return None
                    else:
                        mmap = dict(mmap=True) if load_supports_mmap() else {}
                        t = torch.load(file, map_location="cpu", weights_only=True, **mmap)
                        if not isinstance(t, torch.Tensor) or not self._ok(s, tuple(t.shape), t.dtype):
                            return None
                        shape = tuple(t.shape)
                    rows.append(self._row(path, s, shape, file, ""))
            if self.png:
                for s in self.channels:
                    with Image.open(f"{base}.stage{s}.png") as im:
                        im.verify()
        except Exception:  # missing, truncated or corrupt: redo the image
            return None
        return rows

    def _ok(self, stage: int, shape: Tuple[int, ...], dtype: Any) -> bool:
        return len(shape) == 3 and shape[0] == self.channels[stage] and dtype in (np.dtype(np.float32), torch.float32)


# ---------------------------------------------------------------------------------- pooled vectors
class PooledStore:
    """Mean-pooled vectors of one rank: ``pooled/shard-RRRRR-of-WWWWW.npz`` with ``images``
    (paths relative to INPUT) and ``stage{i}`` ``(N, C_i)`` float32 arrays, one row per image.

    While a rank runs, every :data:`POOL_FLUSH` new vectors go to a ``partial-...npz`` file, so
    an interrupted run keeps them; a rerun reads every shard and partial file it finds (any
    world size), and rank 0 deletes the ones that are not current shards once all ranks are done.
    """

    def __init__(self, out_dir: str, rank: int, world_size: int, channels: Dict[int, int]) -> None:
        self.dir = os.path.join(out_dir, POOL_DIR)
        self.rank, self.world_size, self.channels = rank, world_size, channels
        self.vectors: Dict[str, Dict[int, np.ndarray]] = {}
        self.unflushed: List[str] = []
        self.run_id = f"{time.strftime('%Y%m%d%H%M%S')}.{os.getpid()}"
        self.parts = 0

    @property
    def shard_name(self) -> str:
        return f"shard-{self.rank:05d}-of-{self.world_size:05d}.npz"

    def load_existing(self, wanted: Set[str]) -> Set[str]:
        """Read the vectors of ``wanted`` images from every valid pooled file already on disk;
        the images found."""
        for name in sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []:
            if not POOL_FILE.match(name):
                continue
            try:
                with np.load(os.path.join(self.dir, name), allow_pickle=False) as z:
                    images = z["images"]
                    arrays = {s: z[f"stage{s}"] for s in self.channels}
                if images.ndim != 1 or any(a.shape != (len(images), self.channels[s]) or a.dtype != np.float32
                                           for s, a in arrays.items()):
                    continue
            except Exception:  # cut off or foreign: its images are simply redone
                continue
            for j, image in enumerate(images.tolist()):
                if image in wanted:
                    self.vectors[image] = {s: a[j] for s, a in arrays.items()}
        return set(self.vectors)

    def add(self, image: str, vectors: Dict[int, torch.Tensor]) -> None:
        self.vectors[image] = {s: v.numpy() for s, v in vectors.items()}
        self.unflushed.append(image)
        if len(self.unflushed) >= POOL_FLUSH:
            self.flush()

    def _save(self, name: str, images: Sequence[str]) -> str:
        buf = io.BytesIO()
        arrays = {f"stage{s}": np.stack([self.vectors[i][s] for i in images]) if images else
                  np.zeros((0, c), np.float32) for s, c in self.channels.items()}
        np.savez(buf, images=np.array(list(images), dtype=str), **arrays)
        path = os.path.join(self.dir, name)
        atomic_write(path, buf.getvalue())
        return path

    def flush(self) -> None:
        """Write the vectors not yet on disk to a new partial file."""
        if self.unflushed:
            self.parts += 1
            self._save(f"partial-{self.rank:05d}-of-{self.world_size:05d}-{self.run_id}.{self.parts}.npz", self.unflushed)
            self.unflushed = []

    def write_shard(self, images: Sequence[str]) -> str:
        """The rank's shard: the vectors of ``images`` (done ones, in the rank's order)."""
        self.unflushed = []
        return self._save(self.shard_name, images)

    @staticmethod
    def remove_stale(out_dir: str, world_size: int) -> None:
        """Rank 0, after every rank wrote its shard: delete partial files and other runs' shards."""
        pool_dir = os.path.join(out_dir, POOL_DIR)
        current = {f"shard-{r:05d}-of-{world_size:05d}.npz" for r in range(world_size)}
        for name in os.listdir(pool_dir) if os.path.isdir(pool_dir) else []:
            if POOL_FILE.match(name) and name not in current:
                os.remove(os.path.join(pool_dir, name))


# ---------------------------------------------------------------------------------- data loading
class _InlineExecutor:
    """``ThreadPoolExecutor``'s ``submit`` without threads: runs the call now."""

    def __enter__(self) -> "_InlineExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as err:
            fut.set_exception(err)
        return fut


def _as_is(item: Any) -> Any:
    """DataLoader collate for ``batch_size=None``: samples unchanged (batches form by size later)."""
    return item


class ImageJobs(Dataset):
    """One rank's images, for DataLoader workers: each item is either ``done`` (outputs already
    complete, with their index rows), ``failed`` (unreadable, with the error) or ``ok`` with the
    decoded ``(3, H, W)`` image (uint8; float32 if resized) and, for PNGs, the RGB image shown."""

    def __init__(self, paths: Sequence[str], plan: OutputPlan, resize: Optional[Tuple[int, int]],
                 skip_complete: bool, pooled: Optional[Set[str]], reader: str = "auto",
                 loader: LoaderSettings = LoaderSettings()) -> None:
        self.paths, self.plan, self.resize = list(paths), plan, resize
        self.skip_complete, self.pooled = skip_complete, pooled
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
        except ImageReadError as err:  # not an image, damaged, or refused by mmcv: report, skip, go on
            return dict(i=i, status="failed", error=str(err))
        except Exception as err:  # any other decoder error
            return dict(i=i, status="failed", error=f"{path}: {type(err).__name__}: {err}")
        # mmcv (OpenCV) decodes a JPEG that was cut off with its missing part grey, as the
        # detector would see it: extracted, but said.
        note = (f"{path}: JPEG without its end-of-image marker (cut off?); read as mmcv reads it, the missing "
                "part grey" if self.reader == "mmcv" and jpeg_truncated(data) else None)
        image = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
        if self.resize is not None:
            image = resize_to(image.float(), self.resize)
        shown = None
        if self.plan.png:
            shown = rgb if self.resize is None else np.asarray(Image.fromarray(rgb).resize(tuple(self.resize[::-1])))
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


# ---------------------------------------------------------------------------------- distributed
@dataclass
class DistContext:
    """Where this process stands in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    initialized: bool = False

    def barrier(self) -> None:
        if self.initialized:
            self._collective(dist.barrier)


    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere); waits for all ranks."""
        if not self.initialized:
            return [obj]
        out: Optional[List[Any]] = [None] * self.world_size if self.rank == 0 else None
        self._collective(dist.gather_object, obj, out, dst=0)
        return out

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as err:
            # Another rank died. Stay alive a moment so that torchrun sees that rank fail
            # first (and names it as the root cause), then stops this one.
            time.sleep(PEER_FAILURE_GRACE_S)
            raise RuntimeError(f"rank {self.rank}: another rank stopped before the job finished "
                               f"(see its report); {type(err).__name__}: {err}") from err

    def counter(self, name: str, add: int) -> Optional[int]:
        """Add to a job-wide counter in torchrun's key-value store (no sync between ranks)."""
        if not self.initialized:
            return None
        try:
            return dist.distributed_c10d._get_default_store().add(f"extract_features/{name}", add)
        except Exception:
            return None


def init_distributed(timeout_min: float) -> DistContext:
    """Join the torchrun job described by the environment (gloo: the ranks only exchange
    metadata, never features), or run alone when there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=timeout_min))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), initialized=True)


class Progress:
    """One bar per rank; rank 0's counts every rank's images (through torchrun's store)."""

    def __init__(self, ctx: DistContext, mine: int, total: int, enabled: bool) -> None:
        self.ctx, self.mine, self.total, self.enabled = ctx, mine, total, enabled
        self.done, self.unsent, self.last_sync, self.last_print = 0, 0, 0.0, 0.0
        self.bar = None
        shown_total = total if ctx.rank == 0 else mine
        desc = "extracting" if ctx.world_size == 1 else ("all ranks" if ctx.rank == 0 else f"rank {ctx.rank}")
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=shown_total, unit="img", desc=desc, position=ctx.rank, dynamic_ncols=True)
            except ImportError:  # tqdm is optional: a line every 10 s instead
                self.bar = None
        self.desc, self.shown_total = desc, shown_total

    def update(self, n: int) -> None:
        self.done += n
        self.unsent += n
        now = time.perf_counter()
        if now - self.last_sync < 0.5 and self.done < self.mine:
            return  # the store (and the terminal) hear from this rank at most twice a second
        self.last_sync = now
        job = self.ctx.counter("done", self.unsent)
        self.unsent = 0
        shown = job if (self.ctx.rank == 0 and job is not None) else self.done
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(shown - self.bar.n)
        elif now - self.last_print > 10 or shown == self.shown_total:
            self.last_print = now
            print(f"{self.desc}: {shown}/{self.shown_total} images", file=sys.stderr, flush=True)

    def follow_others(self, timeout_s: float) -> None:
        """Rank 0, its own share done: keep the job-wide bar moving until every rank is done
        (or the store stops answering, or ``timeout_s``; torchrun ends this process if a rank fails)."""
        if self.ctx.rank != 0 or self.ctx.world_size == 1 or not self.enabled:
            return
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            job = self.ctx.counter("done", 0)
            if job is None or job >= self.total:
                break
            if self.bar is not None:
                self.bar.update(job - self.bar.n)
            time.sleep(0.5)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RankFailed(RuntimeError):
    """A rank stopped on an error; its message (already printed) says why and how to finish."""


class Terminated(Exception):
    """SIGTERM (torchrun stopping the job because another rank failed, or a scheduler)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"terminated by signal {signum}")


# ---------------------------------------------------------------------------------- one rank
@dataclass
class RankState:
    """What one rank did: written to ``ranks/rank-RRRRR-of-WWWWW.json`` when it stops, whatever the reason."""

    rank: int
    world_size: int
    assigned: List[str]
    status: str = "running"
    error: Optional[str] = None
    new: int = 0
    resumed: int = 0
    seconds: float = 0.0
    rows: Dict[int, List[dict]] = field(default_factory=dict)  # image index -> rows
    failed: Dict[int, str] = field(default_factory=dict)  # image index -> error
    notes: List[str] = field(default_factory=list)  # images read, but with a remark (a cut-off JPEG)
    in_flight: List[str] = field(default_factory=list)
    pooled_file: Optional[str] = None

    def to_json(self) -> dict:
        done = sorted(self.rows)
        finished = set(done) | set(self.failed)
        return dict(rank=self.rank, world_size=self.world_size, status=self.status, error=self.error,
                    assigned=len(self.assigned), images=len(done), new=self.new, resumed=self.resumed,
                    seconds=round(self.seconds, 3), images_per_second=round(self.new / max(self.seconds, 1e-9), 3),
                    failed=[dict(image=self.assigned[i], error=e) for i, e in sorted(self.failed.items())],
                    in_flight=self.in_flight, pending=[p for i, p in enumerate(self.assigned) if i not in finished],
                    pooled_file=self.pooled_file, notes=self.notes, features=[r for i in done for r in self.rows[i]])

    def path(self, out_dir: str) -> str:
        return os.path.join(out_dir, RANKS_DIR, f"rank-{self.rank:05d}-of-{self.world_size:05d}.json")


def _extract(args: argparse.Namespace, extractor: FeatureExtractor, plan: OutputPlan, state: RankState,
             pooled: Optional[PooledStore], done_pooled: Optional[Set[str]], progress: Progress) -> None:
    """The rank's loop: workers decode, images are batched (mixed sizes where the backbone takes
    per-image valid sizes, else by size), a writer thread writes."""
    cuda = extractor.device.type == "cuda"
    jobs = ImageJobs(state.assigned, plan, tuple(args.resize) if args.resize else None,
                     skip_complete=not args.overwrite, pooled=done_pooled, reader=args.reader, loader=args.loader)
    loader = DataLoader(jobs, batch_size=None, shuffle=False, num_workers=args.workers, collate_fn=_as_is,
                        pin_memory=cuda, prefetch_factor=max(2, args.batch_size) if args.workers else None)
    buckets: "OrderedDict[Optional[Tuple[int, int]], List[dict]]" = OrderedDict()
    max_held = 8 * args.batch_size  # decoded images waiting for same-size partners, at most
    writes: Deque[Tuple[int, Future]] = deque()

    def reap(keep: int) -> None:
        while writes and (len(writes) > keep or writes[0][1].done()):
            i, fut = writes.popleft()
            try:
                state.rows[i] = fut.result()
            except Exception as err:
                state.in_flight = [state.assigned[i]]  # the image the failure is about
                raise RuntimeError(f"writing its outputs: {type(err).__name__}: {err}") from err
            state.new += 1
            progress.update(1)

    def run(batch: List[dict]) -> None:
        state.in_flight = [state.assigned[it["i"]] for it in batch]
        feats = extractor.run_batch([it["image"] for it in batch])
        for it, feat in zip(batch, feats):
            path = state.assigned[it["i"]]
            if pooled is not None:
                pooled.add(plan.key(path), mean_pool(feat))
            writes.append((it["i"], writer.submit(plan.write, path, feat, it["shown"])))
        reap(keep=2 * args.batch_size)

    start = time.perf_counter()
    # On CUDA two threads write while the GPU computes; on the CPU the forward already uses
    # every core, and extra threads there stall its OpenMP regions, so writes happen inline.
    with (ThreadPoolExecutor(max_workers=2, thread_name_prefix="write") if cuda else _InlineExecutor()) as writer:
        try:
            for item in loader:
                if item["status"] == "done":
                    state.rows[item["i"]] = item["rows"]
                    state.resumed += 1
                    progress.update(1)
                elif item["status"] == "failed":
                    state.failed[item["i"]] = item["error"]
                    progress.update(1)
                else:
                    if item.get("note"):
                        state.notes.append(item["note"])
                    # One bucket where the backbone batches mixed sizes exactly, else one per size.
                    size = None if extractor.mixed_sizes else tuple(item["image"].shape[-2:])
                    buckets.setdefault(size, []).append(item)
                    if len(buckets[size]) >= args.batch_size:
                        run(buckets.pop(size))
                    elif sum(map(len, buckets.values())) >= max_held:
                        run(buckets.pop(next(iter(buckets))))  # the oldest size waits no longer
            while buckets:
                run(buckets.pop(next(iter(buckets))))
            reap(keep=0)
        finally:
            state.seconds = time.perf_counter() - start
            for _, fut in writes:
                fut.cancel()
    state.in_flight = []


def _settings(args: argparse.Namespace, channels: Dict[int, int]) -> dict:
    """What decides the features' values: a rerun into the same OUT_DIR must match it."""
    ckpt = None
    if args.checkpoint:
        path, name = args.checkpoint, os.path.basename(args.checkpoint)
        if is_reference(args.checkpoint):  # a URL: its cached file (downloaded once), named by the URL
            path, name = (fetch(args.checkpoint)[0] if resolve(args.checkpoint)[0] != "mmengine" else None), path
        digest = hashlib.sha256()
        if path is not None:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 23), b""):
                    digest.update(chunk)
        ckpt = dict(file=name, sha256=digest.hexdigest() if path is not None else None)
    model = dict(arch=args.arch, embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                 window_size=args.window_size)
    if args.pretrained_window_sizes is not None:  # (V2 only; absent otherwise, as before V2 existed)
        model["pretrained_window_sizes"] = args.pretrained_window_sizes
    return dict(model=dict(config=os.path.abspath(args.config)) if args.config else model,
                checkpoint=ckpt, random_weights_seed=args.seed if args.random_weights else None,
                stages={str(s): c for s, c in channels.items()}, resize=args.resize, mean=list(args.mean),
                std=list(args.std), dtype=args.dtype, reader=args.reader)


def _check_settings(args: argparse.Namespace, ctx: DistContext, settings: dict) -> None:
    path = os.path.join(args.out_dir, SETTINGS_FILE)
    if not args.overwrite and os.path.isfile(path):
        with open(path) as f:
            previous = json.load(f)
        if previous != json.loads(json.dumps(settings)):
            diff = sorted(k for k in set(previous) | set(settings) if previous.get(k) != json.loads(json.dumps(settings)).get(k))
            raise SystemExit(f"out_dir {args.out_dir!r}: holds features made with other settings ({', '.join(diff)} "
                             f"differ, see {path}); pass --overwrite to redo everything, or use another OUT_DIR")
    ctx.barrier()  # every rank has compared before rank 0 replaces the file
    if ctx.rank == 0:
        atomic_write(path, json.dumps(settings, indent=1).encode())


def build_extractor(args: argparse.Namespace, device: str) -> FeatureExtractor:
    common = dict(stages=args.stages, mean=args.mean, std=args.std, resize=args.resize,
                  batch_size=args.batch_size, device=device, dtype=args.dtype, seed=args.seed)
    if args.config:
        return FeatureExtractor.from_config(args.config, args.checkpoint, attention=args.attention, **common)
    if args.attention is not None:
        common["attention"] = args.attention
    return FeatureExtractor.from_arch(args.arch, args.checkpoint, window_size=args.window_size,
                                      embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                                      pretrained_window_sizes=args.pretrained_window_sizes, **common)


def _device(args: argparse.Namespace, ctx: DistContext) -> str:
    device = torch.device(args.device)
    if device.type == "cuda" and ctx.world_size > 1:
        if device.index is not None:
            raise SystemExit(f"--device {args.device}: under torchrun each rank uses cuda:LOCAL_RANK; pass --device cuda")
        torch.cuda.set_device(ctx.local_rank)
        return f"cuda:{ctx.local_rank}"
    return args.device


def _merge(args: argparse.Namespace, states: List[dict], paths: List[str], wall: float, weights: dict,
           warnings: List[str]) -> dict:
    """Rank 0: the index of the whole job, from every rank's state, and the summary."""
    order = {p: i for i, p in enumerate(paths)}
    rows = sorted((r for s in states for r in s["features"]), key=lambda r: (order[r["image"]], r["stage"], r["file"]))
    failed = sorted((f for s in states for f in s["failed"]), key=lambda f: order[f["image"]])
    new, resumed = sum(s["new"] for s in states), sum(s["resumed"] for s in states)
    images = sum(s["images"] for s in states)
    ranks = [{k: s[k] for k in ("rank", "assigned", "images", "new", "resumed", "seconds", "images_per_second")}
             | dict(failed=len(s["failed"])) for s in states]
    pooled = [dict(file=s["pooled_file"], images=s["images"], rank=s["rank"]) for s in states if s["pooled_file"]]
    notes = [n for s in states for n in s.get("notes", [])]
    summary = dict(images=images, new=new, resumed=resumed, failed=failed, notes=notes, reader=reader_label(args),
                   seconds=round(wall, 3),
                   images_per_second=round(new / max(wall, 1e-9), 3), world_size=len(states), workers=args.workers,
                   batch_size=args.batch_size, weights=weights, warnings=warnings, pooled=pooled, ranks=ranks,
                   features=rows)
    atomic_write(os.path.join(args.out_dir, "index.json"), json.dumps(summary, indent=1).encode())
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=INDEX_FIELDS)
    writer.writeheader()
    for row in rows:
        writer.writerow(dict(row, shape="x".join(map(str, row["shape"]))))
    atomic_write(os.path.join(args.out_dir, "index.csv"), buf.getvalue().encode())
    return summary


def run(args: argparse.Namespace, ctx: DistContext) -> dict:
    """Extract this rank's share; on rank 0, merge and return the job's summary (other ranks:
    their own state)."""
    wall_start = time.perf_counter()
    paths, root = find_images(args.input, exclude=args.out_dir)
    if not paths:
        raise SystemExit(f"input {args.input!r}: no images found (files ending in {', '.join(IMAGE_EXTS)}"
                         + (f"; {args.out_dir!r} is OUT_DIR, not searched" if _inside(args.out_dir, args.input) else "")
                         + ")")
    try:
        names = output_names(paths, root)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.workers is None:
        args.workers = default_workers(ctx.local_world_size, args.device)
    _preprocessing(args)
    extractor = build_extractor(args, _device(args, ctx))
    probe = extractor.run_batch([torch.zeros(3, 64, 64)])[0]
    channels = OrderedDict((s, f.shape[0]) for s, f in probe.items())
    plan = OutputPlan(args.out_dir, root, args.format, channels, maps=not args.no_maps, png=args.png, names=names)
    weights = dict(checkpoint=args.checkpoint, random=bool(args.random_weights),
                   seed=args.seed if args.random_weights else None)
    warnings = [RANDOM_WEIGHTS_WARNING] if args.random_weights else []
    if ctx.rank == 0:
        for w in warnings:
            print(f"WARNING: {w}", file=sys.stderr, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    _check_settings(args, ctx, _settings(args, channels))

    state = RankState(ctx.rank, ctx.world_size, paths[ctx.rank :: ctx.world_size])
    pooled = done_pooled = None
    if args.pool:
        pooled = PooledStore(args.out_dir, ctx.rank, ctx.world_size, channels)
        done_pooled = set() if args.overwrite else pooled.load_existing({plan.key(p) for p in state.assigned})
    ctx.barrier()  # every rank has read the old pooled files before any are replaced

    progress = Progress(ctx, len(state.assigned), len(paths), enabled=not args.no_progress)
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    try:
        _extract(args, extractor, plan, state, pooled, done_pooled, progress)
        progress.follow_others(args.dist_timeout * 60)
    except BaseException as err:
        state.status = "interrupted" if isinstance(err, (KeyboardInterrupt, Terminated)) else "failed"
        state.error = f"{type(err).__name__}: {err}"
        if pooled is not None:
            pooled.flush()
        info = state.to_json()
        info["traceback"] = traceback.format_exc()
        atomic_write(state.path(args.out_dir), json.dumps(info, indent=1).encode())
        message = (f"rank {ctx.rank} of {ctx.world_size} {state.status}"
                   + (f" on {', '.join(state.in_flight)}" if state.in_flight else "")
                   + f": {state.error}; {len(info['pending'])} of its {len(state.assigned)} images are not done "
                   f"(listed under 'pending' in {state.path(args.out_dir)}); run the same command again to finish them")
        print(message, file=sys.stderr, flush=True)
        if isinstance(err, Exception) and not isinstance(err, Terminated):
            raise RankFailed(message) from err
        raise
    finally:
        progress.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    state.status = "complete"
    if pooled is not None:
        state.pooled_file = os.path.relpath(pooled.write_shard([plan.key(state.assigned[i]) for i in sorted(state.rows)]),
                                            args.out_dir).replace(os.sep, "/")
    info = state.to_json()
    atomic_write(state.path(args.out_dir), json.dumps(info, indent=1).encode())
    if ctx.world_size > 1:
        print(f"rank {ctx.rank}: {info['new']} new images in {info['seconds']:.1f} s "
              f"({info['images_per_second']:.2f} img/s), {info['resumed']} already complete, "
              f"{len(info['failed'])} skipped", file=sys.stderr, flush=True)
    gathered = ctx.gather(info)  # waits for every rank
    if ctx.rank != 0 or gathered is None:
        return info

    summary = _merge(args, gathered, paths, time.perf_counter() - wall_start, weights, warnings)
    PooledStore.remove_stale(args.out_dir, ctx.world_size)
    ranks_dir = os.path.join(args.out_dir, RANKS_DIR)
    for name in os.listdir(ranks_dir):
        if re.fullmatch(r"rank-\d{5}-of-\d{5}\.json", name) and not name.endswith(f"-of-{ctx.world_size:05d}.json"):
            os.remove(os.path.join(ranks_dir, name))
    for item in summary["failed"]:
        print(f"skipped {item['image']}: {item['error']}", file=sys.stderr)
    for note in summary["notes"]:
        print(f"warning: {note}", file=sys.stderr)
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"done: {summary['images']} images ({summary['new']} new, {summary['resumed']} already complete) on "
          f"{ctx.world_size} rank(s) in {summary['seconds']:.1f} s ({summary['images_per_second']:.2f} new img/s), "
          f"{len(summary['failed'])} skipped, images read with {summary['reader']}", flush=True)
    print(f"index: {os.path.join(args.out_dir, 'index.json')} (and index.csv)", flush=True)
    return summary


def reader_label(args: argparse.Namespace) -> str:
    """How images were decoded, for the summary: mmcv's loader settings, or the Pillow fallback."""
    if args.reader == "mmcv":
        return f"mmcv ({args.loader.imdecode_backend}, color_type={args.loader.color_type!r}, as LoadImageFromFile)"
    return "Pillow (mmcv not installed: EXIF orientation and conversions as mmcv's)"


def _preprocessing(args: argparse.Namespace) -> None:
    """Decoder, loader settings and mean / std: with ``--config``, its test pipeline's
    ``LoadImageFromFile`` and its data preprocessor's (unless --mean / --std are given)."""
    args.reader = resolve_reader(args.reader)
    args.loader = LoaderSettings()
    if args.config:
        from mmengine.config import Config

        from ..images import loader_settings

        cfg = Config.fromfile(args.config)
        args.loader = loader_settings(cfg)
        preprocessor = (cfg.get("model") or {}).get("data_preprocessor") or {}
        if args.mean is None and preprocessor.get("mean") is not None:
            args.mean = [float(v) for v in preprocessor["mean"]]
        if args.std is None and preprocessor.get("std") is not None:
            args.std = [float(v) for v in preprocessor["std"]]
    args.mean = list(IMAGENET_MEAN) if args.mean is None else args.mean
    args.std = list(IMAGENET_STD) if args.std is None else args.std


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------------------------- command line
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="swin-extract-features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="image file, folder or glob")
    p.add_argument("out_dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--arch", default="tiny", help=f"Swin preset (default: tiny). {arch_names()}")
    src.add_argument("--config", help="mmdet / mmseg config whose backbone to use")
    p.add_argument("--embed-dims", type=int, help="override the preset's embed_dims (with --arch)")
    p.add_argument("--depths", type=int, nargs="+", help="override the preset's depths (with --arch)")
    p.add_argument("--num-heads", type=int, nargs="+", help="override the preset's num_heads (with --arch)")
    p.add_argument("--checkpoint", help="weights: any Swin format, or a whole detector/segmentor checkpoint; a file, "
                   "or a URL / torchvision:// / open-mmlab:// / mmcls:// reference as in mmengine (downloaded once "
                   "into torch's hub cache)")
    p.add_argument("--random-weights", action="store_true",
                   help="run without --checkpoint, on random weights (seeded by --seed): for testing only")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-weights (default: 0)")
    p.add_argument("--window-size", type=int, help="attention window (with --arch; default: 7 for Swin V1, 8 for "
                   "a V2 preset, a published V2 model's own)")
    p.add_argument("--pretrained-window-sizes", type=int, nargs="+", metavar="W",
                   help="Swin V2: the window(s) the checkpoint was pre-trained with (one, or one per stage), "
                   "for a larger --window-size (default: a published model's, else the window itself)")
    p.add_argument("--stages", type=int, nargs="+", help="output stages to keep (default: all)")
    p.add_argument("--resize", type=int, nargs=2, metavar=("H", "W"), help="resize every image (default: keep size)")
    p.add_argument("--mean", type=float, nargs=3, metavar=("R", "G", "B"),
                   help="normalisation mean, 0..255 scale (default: the --config's data preprocessor's, else ImageNet's)")
    p.add_argument("--std", type=float, nargs=3, metavar=("R", "G", "B"),
                   help="normalisation std, 0..255 scale, > 0 (default: as --mean)")
    p.add_argument("--reader", choices=READERS, default="auto",
                   help="image decoding: mmcv (as mmdet's / mmseg's LoadImageFromFile: EXIF orientation, 16-bit, "
                   "palette, CMYK...), pil (the same conversions with Pillow, for installs without mmcv) or auto "
                   "(mmcv where installed; default)")
    p.add_argument("--batch-size", type=int, default=4, help="images per forward, all of one input size (default: 4)")
    p.add_argument("--workers", type=int, help="decoding processes per rank (default: CUDA: the rank's share of "
                   "the cores minus one, 1..8; CPU: 1 from 4 cores per rank, else 0 = decode in the main process)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK per rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--attention", choices=("auto", "sdpa", "triton"),
                   help="the attention kernel on CUDA (default: the backbone's, 'auto': measured on this GPU; "
                        "SWIN_BACKBONE_ATTENTION overrides it)")
    p.add_argument("--format", choices=("npz", "npy", "pt"), default="npz")
    p.add_argument("--png", action="store_true", help="also write a PCA visualisation per stage")
    p.add_argument("--pool", choices=("avg",), help="also write one mean-pooled vector per image and stage "
                   "into pooled/shard-RRRRR-of-WWWWW.npz (one file per rank, with its image list)")
    p.add_argument("--no-maps", action="store_true", help="write no per-image feature maps (with --pool or --png)")
    p.add_argument("--overwrite", action="store_true", help="redo every image (default: skip complete outputs)")
    p.add_argument("--dist-timeout", type=float, default=720.0, metavar="MIN",
                   help="how long ranks wait for each other under torchrun, in minutes (default: 720)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no model and no image: a usage error (exit status 2) names the
    option, what it expects and what it got, before anything is loaded."""
    from ..features import check_device, check_stages
    from ..validation import MAX_WINDOW_SIZE

    check_paths(p, args.input, args.out_dir)
    if args.config and not os.path.isfile(args.config):
        p.error(f"--config: no such file {args.config!r}")
    if not args.checkpoint and not args.random_weights:
        p.error("--checkpoint: none given, so the backbone would have random weights and every feature would be "
                "meaningless; pass --checkpoint FILE (any Swin format, or a detector/segmentor checkpoint), or "
                "--random-weights if random weights are really what you want")
    if args.checkpoint and args.random_weights:
        p.error("--random-weights: not allowed with --checkpoint")
    if args.checkpoint and not is_reference(args.checkpoint) and not os.path.isfile(args.checkpoint):
        p.error(f"--checkpoint: {'a folder, expected a file' if os.path.isdir(args.checkpoint) else 'no such file'} "
                f"{args.checkpoint!r}")
    for option, values in (("--embed-dims", [args.embed_dims] if args.embed_dims is not None else None),
                           ("--depths", args.depths), ("--num-heads", args.num_heads),
                           ("--pretrained-window-sizes", args.pretrained_window_sizes)):
        low = 0 if option == "--pretrained-window-sizes" else 1
        if values is not None and min(values) < low:
            p.error(f"{option}: expected ints >= {low}, got {' '.join(map(str, values))}")
    if args.depths and args.num_heads and len(args.depths) != len(args.num_heads):
        p.error(f"--num-heads: expected one per stage ({len(args.depths)} --depths), got {len(args.num_heads)}")
    if args.window_size is not None and not 1 <= args.window_size <= MAX_WINDOW_SIZE:
        p.error(f"--window-size: expected an int in [1, {MAX_WINDOW_SIZE}], got {args.window_size}")
    try:
        check_device(args.device)
    except ValueError as err:
        p.error(f"--{err}")
    for option, values in (("--mean", args.mean), ("--std", args.std)):
        if values is not None and not all(math.isfinite(v) and (v > 0 or option == "--mean") for v in values):
            p.error(f"{option}: expected 3 finite numbers{' > 0' if option == '--std' else ''}, "
                    f"got {' '.join(map(str, values))}")
    if args.stages is not None and not args.config:
        outputs = len(args.depths) if args.depths else 4  # --arch: every stage is an output
        try:
            check_stages(args.stages, outputs)
        except ValueError as err:
            p.error(f"--{err}")
    elif args.stages is not None:
        try:
            check_stages(args.stages, None)
        except ValueError as err:
            p.error(f"--{err}")
    if args.config and (args.embed_dims or args.depths or args.num_heads):
        p.error("--embed-dims/--depths/--num-heads: only with --arch, not --config")
    if args.config and (args.window_size is not None or args.pretrained_window_sizes is not None):
        p.error("--window-size/--pretrained-window-sizes: only with --arch, not --config (the config sets them)")
    if not args.config:
        version, _ = split_arch(args.arch)
        if args.pretrained_window_sizes is not None and version != 2:
            p.error(f"--pretrained-window-sizes: only for Swin V2 presets (v2-tiny, ...), got --arch {args.arch}")
        if args.pretrained_window_sizes is not None and len(args.pretrained_window_sizes) == 1:
            args.pretrained_window_sizes = args.pretrained_window_sizes[0]
        if args.window_size is None:
            args.window_size = default_window_size(args.arch)
    if args.batch_size < 1:
        p.error(f"--batch-size: expected >= 1, got {args.batch_size}")
    if args.workers is not None and args.workers < 0:
        p.error(f"--workers: expected >= 0, got {args.workers}")
    if args.resize and min(args.resize) < 1:
        p.error(f"--resize: expected two sizes >= 1, got {args.resize}")
    if args.no_maps and not (args.pool or args.png):
        p.error("--no-maps: nothing would be written; add --pool avg (or --png)")
    if not math.isfinite(args.dist_timeout) or args.dist_timeout <= 0:
        p.error(f"--dist-timeout: expected > 0 minutes, got {args.dist_timeout}")


def check_paths(p: argparse.ArgumentParser, input_spec: str, out_dir: str) -> None:
    """INPUT exists (a file, a folder or a glob); OUT_DIR is (or can become) a folder that is
    not INPUT itself nor one of the input images."""
    if not (os.path.exists(input_spec) or glob.has_magic(input_spec)):
        p.error(f"input: no such file or folder {input_spec!r} (expected an image file, a folder or a glob)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        p.error(f"out_dir: {out_dir!r} is a file; expected a folder (created if missing)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        p.error(f"out_dir: {out_dir!r} cannot be created: {parent!r} is a file, not a folder")
    if not os.access(parent if not os.path.exists(out_dir) else out_dir, os.W_OK | os.X_OK):
        p.error(f"out_dir: {out_dir!r} is not writable")
    if os.path.isdir(input_spec) and os.path.realpath(input_spec) == os.path.realpath(out_dir):
        p.error(f"out_dir: {out_dir!r} is the input folder itself; expected another folder (a subfolder is "
                "fine: it is never searched for images)")


def extract(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` and extract: rank 0's summary (``index.json``'s content) or, on other
    ranks, the rank's own state. Errors raise (usage errors: ``SystemExit(2)``); for the
    command line use :func:`main`."""
    args = parse_args(argv)
    ctx = init_distributed(args.dist_timeout)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun shows the failing rank's traceback
        from torch.distributed.elastic.multiprocessing.errors import record

        result = record(run)(args, ctx)
    else:
        result = run(args, ctx)
    ctx.barrier()  # every rank done (rank 0 has written the index)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point (``swin-extract-features``): the exit status. 0: done (a
    summary on stdout, the index in OUT_DIR); 2: a usage error (argparse); 1: a failure, said
    in one line on stderr (also when not one image could be read).

    Under torchrun the process ends here, without tearing the process group down
    (:func:`~swin_backbone.tools.job.leave_job`)."""
    try:
        code = _main(argv)
    except BaseException as err:  # (a usage error comes before the job is joined)
        if not in_job():
            raise
        if not isinstance(err, SystemExit):
            traceback.print_exc()
        code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1
    leave_job(code)
    return code


def _main(argv: Optional[Sequence[str]]) -> int:
    prog = "swin-extract-features"
    try:
        summary = extract(argv)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # our own SystemExit("why"): one line, status 1
            print(f"{prog}: error: {exit_.code}", file=sys.stderr)
            return 1
        raise  # argparse: its usage message and status 2
    except RankFailed:
        return 1  # run() already said which rank, why, and how to finish
    except (ValueError, OSError, RuntimeError) as err:
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    if summary.get("failed") and not summary.get("images") and "rank" not in summary:
        print(f"{prog}: error: none of the {len(summary['failed'])} images could be read (each is listed above "
              "and in index.json 'failed')", file=sys.stderr)
        return 1
    return 0


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())

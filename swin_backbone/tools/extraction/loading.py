"""Decoding images in DataLoader worker processes: one item per image, already complete, unreadable
or decoded."""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ...features import resize_to
from ...images import ImageReadError, LoaderSettings, decode_rgb, jpeg_truncated, read_bytes, resolve_reader
from .outputs import OutputPlan


def as_is(item: Any) -> Any:
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

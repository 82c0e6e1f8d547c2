"""One image's output files: feature maps (``.npz``, ``.npy`` or ``.pt``) and PCA pictures, each
written whole, and the check that a rerun can skip an image whose files are complete."""
from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from ...features import pca_rgb, side_by_side
from ...torch_compat import load_supports_mmap
from ..common import atomic_write


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

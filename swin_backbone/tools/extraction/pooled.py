"""``--pool avg``: one rank's mean-pooled vectors, kept in shard files that survive an
interrupted run."""
from __future__ import annotations

import io
import os
import re
import time
from typing import Dict, List, Sequence, Set

import numpy as np
import torch

from ..common import atomic_write

POOL_DIR = "pooled"
#: New pooled vectors a rank keeps in memory before writing them to a partial file (resume point).
POOL_FLUSH = 1024
POOL_FILE = re.compile(r"^(shard|partial)-(\d{5})-of-(\d{5})(-[A-Za-z0-9_.]+)?\.npz$")


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
            name = f"partial-{self.rank:05d}-of-{self.world_size:05d}-{self.run_id}.{self.parts}.npz"
            self._save(name, self.unflushed)
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

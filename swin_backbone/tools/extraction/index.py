"""Rank 0's summary of the whole job, written as ``index.json`` and ``index.csv``."""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
from typing import List

from ..common import atomic_write
from .settings import reader_label

INDEX_FIELDS = ["image", "stage", "shape", "dtype", "file", "key"]


def write_index(args: argparse.Namespace, states: List[dict], paths: List[str], wall: float, weights: dict,
                warnings: List[str]) -> dict:
    """Rank 0: the index of the whole job, from every rank's state, and the summary."""
    order = {p: i for i, p in enumerate(paths)}
    rows = sorted((r for s in states for r in s["features"]), key=lambda r: (order[r["image"]], r["stage"], r["file"]))
    failed = sorted((f for s in states for f in s["failed"]), key=lambda f: order[f["image"]])
    new, resumed = sum(s["new"] for s in states), sum(s["resumed"] for s in states)
    images = sum(s["images"] for s in states)
    ranks = [dict({k: s[k] for k in ("rank", "assigned", "images", "new", "resumed", "seconds", "images_per_second")},
                  failed=len(s["failed"])) for s in states]  # (not ``|``: Python 3.8 has no dict union)
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

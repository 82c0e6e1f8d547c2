#!/usr/bin/env python
"""Write small, learnable datasets in the real COCO and ADE20K layouts.

Images show up to three simple shapes (square, disc, triangle; one colour family each) on
a noisy background, at varied, deliberately odd sizes. Everything is deterministic for a
given seed.

Layouts written under ``--out``::

    toy_coco/
      train2017/*.jpg  val2017/*.jpg
      annotations/instances_train2017.json  annotations/instances_val2017.json
    toy_ade/ADEChallengeData2016/
      images/training/*.jpg        images/validation/*.jpg
      annotations/training/*.png   annotations/validation/*.png

COCO annotations carry boxes, polygon masks, areas and categories. ADE20K label PNGs use
0 = unlabelled (ignored by ``reduce_zero_label``), 1 = background, 2.. = the shapes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw

from ..checkpoint.files import atomic_write

CLASSES = ("square", "disc", "triangle")
COLOURS = ((200, 40, 40), (40, 170, 60), (40, 70, 210))  # base colour per class
ADE_CLASSES = ("background",) + CLASSES


@dataclass
class Shape:
    label: int  # index into CLASSES
    polygon: List[Tuple[float, float]]

    def bbox(self) -> Tuple[float, float, float, float]:
        xs, ys = zip(*self.polygon)
        return min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)


def _polygon(label: int, cx: float, cy: float, r: float, angle: float) -> List[Tuple[float, float]]:
    if label == 0:  # square, rotated
        corners = [angle + math.pi / 4 + k * math.pi / 2 for k in range(4)]
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in corners]
    if label == 1:  # disc as a 32-gon
        return [(cx + r * math.cos(2 * math.pi * k / 32), cy + r * math.sin(2 * math.pi * k / 32)) for k in range(32)]
    corners = [angle + 2 * math.pi * k / 3 for k in range(3)]
    return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in corners]


def make_scene(rng: np.random.RandomState, width: int, height: int) -> Tuple[Image.Image, List[Shape], np.ndarray]:
    """One image, its shapes (drawn back to front), and its ADE-style label map."""
    base = rng.randint(150, 235, size=3)
    pixels = np.clip(base[None, None, :] + rng.normal(0, 8, size=(height, width, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    labels = Image.new("L", (width, height), 1)
    label_draw = ImageDraw.Draw(labels)
    shapes: List[Shape] = []
    placed: List[Tuple[float, float, float]] = []
    for _ in range(rng.randint(1, 4)):
        for _attempt in range(20):
            r = rng.uniform(0.12, 0.24) * min(width, height)
            cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
            if all(math.hypot(cx - x, cy - y) > r + rr + 2 for x, y, rr in placed):
                break
        else:
            continue
        label = int(rng.randint(len(CLASSES)))
        polygon = _polygon(label, cx, cy, r, rng.uniform(0, 2 * math.pi))
        colour = tuple(int(np.clip(c + rng.randint(-25, 26), 0, 255)) for c in COLOURS[label])
        draw.polygon(polygon, fill=colour)
        label_draw.polygon(polygon, fill=label + 2)
        shapes.append(Shape(label, polygon))
        placed.append((cx, cy, r))
    return image, shapes, np.asarray(labels)


def _sizes(rng: np.random.RandomState, n: int, min_size: int, max_size: int) -> Sequence[Tuple[int, int]]:
    return [(int(rng.randint(min_size, max_size + 1)), int(rng.randint(min_size, max_size + 1))) for _ in range(n)]


def write_coco(root: str, split: str, n: int, rng: np.random.RandomState, min_size: int, max_size: int) -> str:
    img_dir = os.path.join(root, f"{split}2017")
    ann_dir = os.path.join(root, "annotations")
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    images, annotations = [], []
    for image_id, (w, h) in enumerate(_sizes(rng, n, min_size, max_size), start=1):
        image, shapes, _ = make_scene(rng, w, h)
        name = f"{image_id:06d}.jpg"
        image.save(os.path.join(img_dir, name), quality=95)
        images.append(dict(id=image_id, file_name=name, width=w, height=h))
        for shape in shapes:
            x, y, bw, bh = shape.bbox()
            poly = [round(v, 2) for point in shape.polygon for v in point]
            area = 0.5 * abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(shape.polygon, shape.polygon[1:] + shape.polygon[:1])))
            annotations.append(
                dict(
                    id=len(annotations) + 1,
                    image_id=image_id,
                    category_id=shape.label + 1,
                    bbox=[round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)],
                    area=round(area, 2),
                    segmentation=[poly],
                    iscrowd=0,
                )
            )
    categories = [dict(id=i + 1, name=name, supercategory="shape") for i, name in enumerate(CLASSES)]
    path = os.path.join(ann_dir, f"instances_{split}2017.json")
    atomic_write(path, json.dumps(dict(images=images, annotations=annotations, categories=categories)))
    return path


def write_ade(root: str, split: str, n: int, rng: np.random.RandomState, min_size: int, max_size: int) -> str:
    img_dir = os.path.join(root, "images", split)
    ann_dir = os.path.join(root, "annotations", split)
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    for index, (w, h) in enumerate(_sizes(rng, n, min_size, max_size), start=1):
        image, _, labels = make_scene(rng, w, h)
        stem = f"ADE_{split[:5]}_{index:08d}"
        image.save(os.path.join(img_dir, stem + ".jpg"), quality=95)
        Image.fromarray(labels.astype(np.uint8)).save(os.path.join(ann_dir, stem + ".png"))
    return ann_dir


def main(argv: Sequence[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data", help="output root (default: data)")
    parser.add_argument("--which", choices=("coco", "ade", "both"), default="both")
    parser.add_argument("--num-train", type=int, default=200)
    parser.add_argument("--num-val", type=int, default=50)
    parser.add_argument("--min-size", type=int, default=120)
    parser.add_argument("--max-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.min_size < 32 or args.max_size < args.min_size:
        parser.error(f"--min-size/--max-size: expected 32 <= min <= max, got {args.min_size}, {args.max_size}")
    if args.which in ("coco", "both"):
        root = os.path.join(args.out, "toy_coco")
        for split, n, offset in (("train", args.num_train, 0), ("val", args.num_val, 1)):
            path = write_coco(root, split, n, np.random.RandomState(args.seed * 2 + offset), args.min_size, args.max_size)
            print(f"wrote {n} images + {path}")
    if args.which in ("ade", "both"):
        root = os.path.join(args.out, "toy_ade", "ADEChallengeData2016")
        for split, n, offset in (("training", args.num_train, 10), ("validation", args.num_val, 11)):
            path = write_ade(root, split, n, np.random.RandomState(args.seed * 2 + offset), args.min_size, args.max_size)
            print(f"wrote {n} images + labels in {path}")


if __name__ == "__main__":
    main()

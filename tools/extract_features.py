#!/usr/bin/env python
"""Turn images into multi-scale Swin feature maps.

    python tools/extract_features.py INPUT OUT_DIR --arch tiny --checkpoint swin_t.pth
    python tools/extract_features.py 'photos/*.jpg' feats --config configs/mmdet/X.py --checkpoint det.pth

INPUT is an image file, a folder (searched recursively) or a glob. For each image, OUT_DIR
gets, at the image's relative path: ``NAME.npz`` (all stages) or ``NAME.stage{i}.npy|.pt``,
and with ``--png`` a ``NAME.stage{i}.png`` per stage (the image beside the first three
principal components of the features as RGB). ``index.json`` and ``index.csv`` list image,
stage, shape, dtype and file. Unreadable images are reported and skipped. Every file is
written to a temporary name and renamed, so a killed run never leaves half-written files.
Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone.features import DTYPES, IMAGENET_MEAN, IMAGENET_STD, FeatureExtractor, pca_rgb, side_by_side  # noqa: E402

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")


def find_images(spec: str) -> Tuple[List[str], str]:
    """Image paths for a file, folder or glob, and the root their output paths are relative to."""
    if os.path.isdir(spec):
        paths = [os.path.join(d, f) for d, _, files in os.walk(spec) for f in files if f.lower().endswith(IMAGE_EXTS)]
        return sorted(paths), spec
    if os.path.isfile(spec):
        return [spec], os.path.dirname(spec) or "."
    paths = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p) and p.lower().endswith(IMAGE_EXTS))
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else "."
    return paths, root


def atomic_write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


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


def write_outputs(args, root: str, path: str, image: np.ndarray, feat: Dict[int, torch.Tensor], index_rows: list) -> None:
    """Write one image's feature files (and PNGs), appending their index rows."""
    base = os.path.join(args.out_dir, os.path.splitext(os.path.relpath(path, root))[0])
    for suffix, data in serialise(feat, args.format).items():
        atomic_write(base + suffix, data)
        for s, f in feat.items():
            if suffix == ".npz" or suffix.startswith(f".stage{s}."):
                index_rows.append(dict(image=path, stage=s, shape=list(f.shape), dtype=str(f.dtype).replace("torch.", ""),
                                       file=os.path.relpath(base + suffix, args.out_dir),
                                       key=f"stage{s}" if suffix == ".npz" else ""))
    if args.png:
        shown = image if args.resize is None else np.asarray(Image.fromarray(image).resize(tuple(args.resize[::-1])))
        for s, f in feat.items():
            atomic_write(f"{base}.stage{s}.png", png_bytes(side_by_side(shown, [pca_rgb(f)])))


def parse_args(argv: Sequence[str] = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="image file, folder or glob")
    p.add_argument("out_dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--arch", default="tiny", help="SwinBackbone preset (default: tiny)")
    src.add_argument("--config", help="mmdet / mmseg config whose backbone to use")
    p.add_argument("--checkpoint", help="weights: any Swin format, or a whole detector/segmentor checkpoint")
    p.add_argument("--window-size", type=int, default=7)
    p.add_argument("--stages", type=int, nargs="+", help="output stages to keep (default: all)")
    p.add_argument("--resize", type=int, nargs=2, metavar=("H", "W"), help="resize every image (default: keep size)")
    p.add_argument("--mean", type=float, nargs=3, default=IMAGENET_MEAN)
    p.add_argument("--std", type=float, nargs=3, default=IMAGENET_STD)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--format", choices=("npz", "npy", "pt"), default="npz")
    p.add_argument("--png", action="store_true", help="also write a PCA visualisation per stage")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] = None) -> dict:
    args = parse_args(argv)
    paths, root = find_images(args.input)
    if not paths:
        raise SystemExit(f"input {args.input!r}: no images found")
    common = dict(stages=args.stages, mean=args.mean, std=args.std, resize=args.resize,
                  batch_size=args.batch_size, device=args.device, dtype=args.dtype)
    if args.config:
        extractor = FeatureExtractor.from_config(args.config, args.checkpoint, **common)
    else:
        extractor = FeatureExtractor.from_arch(args.arch, args.checkpoint, window_size=args.window_size, **common)

    from tqdm import tqdm

    # Pass 1 reads only image headers (sizes), so batches of one size can be formed without
    # holding every decoded image in memory; pass 2 decodes a batch at a time.
    sizes, ok_paths, failed = [], [], []
    for path in paths:
        try:
            with Image.open(path) as im:
                sizes.append((im.height, im.width))
            ok_paths.append(path)
        except Exception as err:  # any decoder error: report, skip, go on
            failed.append({"image": path, "error": f"{type(err).__name__}: {err}"})
    index_rows, done = [], []
    start = time.perf_counter()
    bar = tqdm(total=len(ok_paths), unit="img", disable=args.no_progress, desc="extracting")
    for batch_idx in extractor.batches(sizes):
        decoded = {}
        for i in batch_idx:
            try:
                with Image.open(ok_paths[i]) as im:
                    decoded[i] = np.array(im.convert("RGB"))
            except Exception as err:  # truncated data shows only when decoding
                failed.append({"image": ok_paths[i], "error": f"{type(err).__name__}: {err}"})
        keep = [i for i in batch_idx if i in decoded]
        feats = extractor.run_batch([torch.from_numpy(decoded[i]).permute(2, 0, 1).float() for i in keep]) if keep else []
        for i, feat in zip(keep, feats):
            write_outputs(args, root, ok_paths[i], decoded[i], feat, index_rows)
            done.append(ok_paths[i])
        bar.update(len(batch_idx))
        bar.set_postfix(img_per_s=f"{bar.n / max(time.perf_counter() - start, 1e-9):.2f}")
    bar.close()
    elapsed = time.perf_counter() - start
    for item in failed:
        print(f"skipped {item['image']}: {item['error']}", file=sys.stderr)

    os.makedirs(args.out_dir, exist_ok=True)
    summary = dict(images=len(done), failed=failed, seconds=round(elapsed, 3),
                   images_per_second=round(len(done) / max(elapsed, 1e-9), 3), features=index_rows)
    atomic_write(os.path.join(args.out_dir, "index.json"), json.dumps(summary, indent=1).encode())
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["image", "stage", "shape", "dtype", "file", "key"])
    writer.writeheader()
    for row in index_rows:
        writer.writerow(dict(row, shape="x".join(map(str, row["shape"]))))
    atomic_write(os.path.join(args.out_dir, "index.csv"), buf.getvalue().encode())
    print(f"done: {len(done)} images in {elapsed:.1f} s ({summary['images_per_second']:.2f} img/s), "
          f"{len(failed)} skipped, index in {os.path.join(args.out_dir, 'index.json')}")
    return summary


if __name__ == "__main__":
    main()

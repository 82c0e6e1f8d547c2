"""swin-buckets: the batch shapes an mmdet config's training produces, and shape buckets for them.

Draws ``--draws`` batches as mmdet builds them: original image sizes (``--ann-file``, a COCO json,
else :data:`COCO_LIKE`), the pipeline's geometric transforms (the config's own, built from mmdet's
``TRANSFORMS`` and run on a one-channel dummy image of each size), aspect-ratio grouping
(``AspectRatioBatchSampler``: landscape ``w >= h`` and portrait batches fill separately) and the
preprocessor's padding (each batch to its largest height and width, rounded up to
``pad_size_divisor``). Then, for a bucket set (``--buckets``, ``--buckets-from``, else the
config's own ``model.data_preprocessor.buckets``), it prints the distinct batch shapes without
buckets, the captures with them (distinct buckets used, plus the shapes no bucket holds), the
padding share (``1 - image pixels / batch pixels``) and the batches no bucket holds.
``--pick K`` chooses K buckets holding every drawn batch at the least padding (docs/shape-buckets.md).

    swin-buckets configs/mmdet/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py --pick 3
    swin-buckets mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py --buckets 800x1344 --json out.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os.path as osp
import random
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..buckets import Shape, check_buckets, choose_bucket
from .common import int_arg

#: A batch: its padded shape ``(H, W)`` in pixels and its images' shapes after the pipeline.
Batch = Tuple[Shape, Tuple[Shape, ...]]

#: Original image sizes ``(width, height, weight)`` standing in for COCO train2017 when no
#: ``--ann-file`` is given. An approximation, not counted from the annotation file: COCO's images
#: are Flickr photos scaled to 640 pixels on the long side (a few percent smaller, e.g. 500x375),
#: about two thirds landscape, 640x480 and 640x427 by far the most common; the weights here are
#: rounded guesses of that shape. For real figures pass ``--ann-file instances_train2017.json``.
COCO_LIKE: Tuple[Tuple[int, int, float], ...] = (
    (640, 480, 30), (640, 427, 14), (640, 426, 5), (640, 428, 4), (640, 424, 3), (640, 425, 2),
    (640, 429, 1), (640, 360, 2), (640, 400, 1), (640, 512, 1), (640, 383, 1), (640, 453, 1),
    (640, 640, 1.5), (612, 612, 1), (500, 375, 1.5),
    (480, 640, 13), (427, 640, 7), (426, 640, 2), (428, 640, 2), (424, 640, 2), (425, 640, 1),
    (360, 640, 1), (512, 640, 1), (375, 500, 1),
)
#: Transforms that move no pixel of the image's frame: not run (photometric ones need 3 channels).
NON_GEOMETRIC = ("PhotoMetricDistortion", "Normalize", "ColorTransform", "Brightness", "Contrast", "Color",
                 "Equalize", "AutoContrast", "Sharpness", "Posterize", "Solarize", "Invert", "RandomErasing",
                 "CachedMosaic", "CachedMixUp", "Albu", "FilterAnnotations", "ImageToTensor", "ToTensor")


def parse_shape(text: str) -> Shape:
    """``'800x1344'`` as ``(800, 1344)`` (height x width, pixels); argparse's error otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH in pixels (e.g. 800x1344), got {text!r}")
    return int(parts[0]), int(parts[1])


def read_config(name: str):
    """The mmengine ``Config`` of a path, ``swin_backbone::<rel>``, or a shipped config's path under
    configs/ (``mmdet/x.py``) or file name (``x.py``, ``x``); ``ValueError`` / ``OSError`` in one line."""
    from mmengine.config import Config

    from .common import one_line
    from .runner import _missing_libraries, shipped_config

    path = name
    if not osp.isfile(name):
        root = shipped_config("swin_backbone::")
        rel = name.split("::", 1)[-1]
        rel = rel if rel.endswith(".py") else rel + ".py"
        found = [osp.join(root, rel)] if osp.isfile(osp.join(root, rel)) else glob.glob(osp.join(root, "*", rel))
        if len(found) != 1:
            raise FileNotFoundError(f"config {name!r}: no such file, nor a shipped config under {root}")
        path = found[0]
    try:
        return Config.fromfile(path)
    except Exception as err:  # syntax errors, unknown bases, a library not installed
        raise ValueError(f"config {name!r}: cannot be read ({type(err).__name__}: {one_line(err)})"
                         + _missing_libraries(path)) from err


def _type_name(transform: dict) -> str:
    kind = transform.get("type")
    return getattr(kind, "__name__", str(kind))


def geometric(pipeline: Sequence[dict]) -> List[dict]:
    """The pipeline without loading, packing and photometric transforms (:data:`NON_GEOMETRIC`)."""
    names = [_type_name(t) for t in pipeline]
    keep = [not name.startswith(("Load", "Pack")) and name not in NON_GEOMETRIC for name in names]
    return [t for t, k in zip(pipeline, keep) if k]


def settings(cfg, split: str = "train", batch_size: Optional[int] = None) -> Dict[str, object]:
    """What shapes a batch in ``cfg``: ``pipeline`` (geometric transforms), ``batch_size``,
    ``grouped`` (AspectRatioBatchSampler) and ``divisor`` (``pad_size_divisor``, pixels)."""
    loader = cfg[f"{split}_dataloader"]
    dataset = loader["dataset"]
    while "pipeline" not in dataset and "dataset" in dataset:  # RepeatDataset / ClassBalancedDataset wrappers
        dataset = dataset["dataset"]
    preprocessor = cfg.model.get("data_preprocessor", {})
    sampler = loader.get("batch_sampler") or {}
    return dict(pipeline=geometric(dataset["pipeline"]), batch_size=int(batch_size or loader["batch_size"]),
                grouped="AspectRatio" in _type_name(sampler) if sampler else False,
                divisor=int(preprocessor.get("pad_size_divisor", preprocessor.get("size_divisor")) or 1))


def original_sizes(ann_file: Optional[str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(sizes, p)``: original ``(width, height)`` pairs (N, 2) and their probabilities (N,)."""
    if ann_file is None:
        table = np.array(COCO_LIKE, dtype=np.float64)
        return table[:, :2].astype(np.int64), table[:, 2] / table[:, 2].sum()
    with open(ann_file, encoding="utf-8") as f:
        images = json.load(f).get("images") or []
    if not images:
        raise ValueError(f"--ann-file {ann_file!r}: no images[] with width and height (expected a COCO json)")
    sizes = np.array([(im["width"], im["height"]) for im in images], dtype=np.int64)
    return sizes, np.full(len(sizes), 1.0 / len(sizes))


def pad_up(value: int, divisor: int) -> int:
    """``value`` rounded up to a multiple of ``divisor``."""
    return -(-value // divisor) * divisor


def draw_batches(cfg, split: str = "train", draws: int = 2000, seed: int = 0, batch_size: Optional[int] = None,
                 ann_file: Optional[str] = None) -> Tuple[List[Batch], Dict[str, object]]:
    """``draws`` batches of ``cfg``'s ``split`` loader (:data:`Batch`), and its :func:`settings`."""
    from mmengine.registry import DefaultScope

    info = settings(cfg, split, batch_size)
    scope = cfg.get("default_scope", "mmdet")
    try:
        from mmcv.transforms import Compose

        __import__(f"{scope}.datasets.transforms")  # registers the library's transforms
    except ImportError as err:
        raise ValueError(f"the config's transforms need {scope} ({err}): pip install "
                         f"'swin-backbone[{scope}-lite]' (no mmcv) or 'swin-backbone[{scope}]'") from err
    with DefaultScope.overwrite_default_scope(scope):
        pipeline = Compose(info["pipeline"])
    sizes, p = original_sizes(ann_file)
    rng = np.random.default_rng(seed)
    np.random.seed(seed)  # the transforms' own randomness
    random.seed(seed)
    pending: Dict[bool, List[Shape]] = {False: [], True: []}
    batches: List[Batch] = []
    while len(batches) < draws:
        for w, h in sizes[rng.choice(len(sizes), size=256, p=p)].tolist():
            try:
                out = pipeline(dict(img=np.zeros((h, w), np.uint8), img_shape=(h, w), ori_shape=(h, w)))
            except Exception as err:  # a transform that needs more than an image (annotations, 3 channels)
                raise ValueError(f"{split} pipeline {[_type_name(t) for t in info['pipeline']]}: failed on a "
                                 f"{h}x{w} dummy image ({type(err).__name__}: {err}); swin-buckets runs mmdet's "
                                 "geometric transforms") from err
            group = pending[bool(info["grouped"]) and w < h]  # the sampler groups by the original size
            group.append(tuple(out["img_shape"][:2]))
            if len(group) == info["batch_size"]:
                shape = tuple(pad_up(max(s[i] for s in group), info["divisor"]) for i in (0, 1))
                batches.append((shape, tuple(group)))
                group.clear()
                if len(batches) == draws:
                    break
    return batches, info


def summarize(batches: Sequence[Batch], buckets: Sequence[Shape] = ()) -> Dict[str, object]:
    """Shapes, captures and padding share (``1 - image pixels / batch pixels``) of ``batches``,
    without buckets and with ``buckets`` (each batch padded to :func:`choose_bucket`'s pick)."""
    image = sum(h * w for _, images in batches for h, w in images)
    batch_pixels = bucketed = 0
    used: Counter = Counter()
    misfits: Counter = Counter()
    for shape, images in batches:
        bucket = choose_bucket(*shape, buckets) if buckets else shape
        (used if bucket is not None else misfits)[bucket or shape] += 1
        batch_pixels += len(images) * shape[0] * shape[1]
        bucketed += len(images) * (bucket or shape)[0] * (bucket or shape)[1]
    return dict(batches=len(batches), shapes=len({s for s, _ in batches}), padding=1 - image / batch_pixels,
                buckets=[list(b) for b in buckets], captures=len(used) + len(misfits),
                padding_buckets=1 - image / bucketed, misfit_batches=sum(misfits.values()),
                misfit_shapes=sorted(list(s) for s in misfits))


def pick(batches: Sequence[Batch], k: int, bound: Optional[Shape] = None) -> List[Shape]:
    """``k`` buckets ``(H, W)``, ``H <= W`` (each serves both orientations), holding every batch at
    the least total batch area: greedy from ``bound`` (kept; default: the drawn batches' bounding
    shape), then swaps while they help. ``ValueError`` if ``bound`` does not hold every batch."""
    counts = Counter((min(s), max(s)) for s, images in batches for _ in images)  # weighted by images
    shapes = np.array(sorted(counts), dtype=np.int64)
    n = np.array([counts[tuple(s)] for s in shapes.tolist()], dtype=np.float64)
    first = (min(bound), max(bound)) if bound else (int(shapes[:, 0].max()), int(shapes[:, 1].max()))
    if first[0] < shapes[:, 0].max() or first[1] < shapes[:, 1].max():
        raise ValueError(f"--bound {bound[0]}x{bound[1]}: smaller than the drawn batches (up to "
                         f"{shapes[:, 0].max()} x {shapes[:, 1].max()}, short x long side)")
    cands = np.array(sorted({(h, w) for h in shapes[:, 0].tolist() for w in shapes[:, 1].tolist() if h <= w} | {first}))
    area = (cands[:, 0] * cands[:, 1]).astype(np.float64)
    cost = np.where((cands[:, :1] >= shapes[:, 0]) & (cands[:, 1:] >= shapes[:, 1]), area[:, None], np.inf)

    def totals(rest: List[int]) -> np.ndarray:
        """The total batch area of ``rest`` plus each candidate (``inf``: some batch held by none)."""
        out = np.minimum(cost, cost[rest].min(axis=0)) @ n if rest else cost @ n
        out[rest] = np.inf
        return out

    chosen = [int(np.flatnonzero((cands[:, 0] == first[0]) & (cands[:, 1] == first[1]))[0])]
    while len(chosen) < min(k, len(cands)):
        chosen.append(int(totals(chosen).argmin()))
    improved = True
    while improved:  # swaps: each slot (but a given bound) to the best candidate given the others
        improved = False
        for i in range(1 if bound else 0, len(chosen)):
            trial = totals(chosen[:i] + chosen[i + 1:])
            if trial.min() < trial[chosen[i]] - 1e-6:
                chosen[i], improved = int(trial.argmin()), True
    return sorted(tuple(int(v) for v in cands[c]) for c in chosen)


def table(row_names: Sequence[str], columns: Dict[str, Sequence[str]]) -> str:
    """A plain text table: one row per name, one column per ``columns`` entry."""
    heads = list(columns)
    width0 = max(len(r) for r in row_names)
    widths = [max(len(h), *(len(v) for v in columns[h])) for h in heads]
    lines = [" " * width0 + "".join(f"  {h:>{w}}" for h, w in zip(heads, widths))]
    for i, name in enumerate(row_names):
        lines.append(f"{name:<{width0}}" + "".join(f"  {columns[h][i]:>{w}}" for h, w in zip(heads, widths)))
    return "\n".join(lines)


def column(summary: Dict[str, object], bucketed: bool) -> List[str]:
    """One :func:`table` column of a :func:`summarize` result: shapes (captures), padding, misfits."""
    if not bucketed:
        return [str(summary["shapes"]), f"{summary['padding']:.1%}", "-"]
    return [str(summary["captures"]), f"{summary['padding_buckets']:.1%}", str(summary["misfit_batches"])]


def main(argv: Optional[Sequence[str]] = None) -> None:
    from .runner import program, setup_errors

    parser = argparse.ArgumentParser(prog=program("buckets.py"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="an mmdet config: a path or a shipped config (mmdet/<name>.py)")
    parser.add_argument("--split", choices=("train", "test"), default="train", help="which dataloader (default train)")
    parser.add_argument("--draws", type=int_arg(1), default=2000, help="batches to draw (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int_arg(1), help="images per batch (default: the dataloader's)")
    parser.add_argument("--ann-file", help="a COCO json whose images[] width/height are the original sizes")
    parser.add_argument("--buckets", nargs="+", type=parse_shape, metavar="HxW", help="a bucket set, e.g. 800x1344")
    parser.add_argument("--buckets-from", metavar="CONFIG", help="the bucket set of CONFIG's model.data_preprocessor")
    parser.add_argument("--pick", type=int_arg(1), metavar="K", help="choose K buckets (each serves both orientations)")
    parser.add_argument("--bound", type=parse_shape, metavar="HxW",
                        help="a bucket --pick keeps (default: the drawn batches' bounding shape); e.g. 1344x1344 "
                             "holds every batch of images at most 1344 on their long side")
    parser.add_argument("--json", metavar="PATH", help="write the numbers here")
    args = parser.parse_args(argv)
    if args.buckets and args.buckets_from:
        parser.error("--buckets and --buckets-from: give one")
    with setup_errors(program("buckets.py")):
        cfg = read_config(args.config)
        if args.buckets_from:
            other = read_config(args.buckets_from)
            buckets = check_buckets(other.model.get("data_preprocessor", {}).get("buckets"), "--buckets-from")
            if not buckets:
                raise ValueError(f"--buckets-from {args.buckets_from!r}: no model.data_preprocessor.buckets")
        else:
            buckets = tuple(args.buckets or ()) or check_buckets(
                cfg.model.get("data_preprocessor", {}).get("buckets"), "model.data_preprocessor.buckets")
        batches, info = draw_batches(cfg, args.split, args.draws, args.seed, args.batch_size, args.ann_file)
        picked = pick(batches, args.pick, args.bound) if args.pick else []
    result = dict(config=args.config, split=args.split, draws=args.draws, seed=args.seed,
                  sizes=args.ann_file or "COCO_LIKE", unbucketed=summarize(batches),
                  **{key: info[key] for key in ("batch_size", "grouped", "divisor")})
    columns = {"no buckets": column(result["unbucketed"], False)}
    if buckets:
        result["given"] = summarize(batches, buckets)
        columns["buckets " + " ".join(f"{h}x{w}" for h, w in buckets)] = column(result["given"], True)
    if picked:
        result["picked"] = summarize(batches, picked)
        columns[f"picked {args.pick}"] = column(result["picked"], True)
    print(f"{args.config}: {args.split}, {args.draws} batches of {info['batch_size']} "
          f"({'aspect-ratio grouped' if info['grouped'] else 'in order'}), pad_size_divisor {info['divisor']}, "
          f"sizes from {args.ann_file or 'the built-in COCO-like table'}; longest image side "
          f"{max(max(s) for _, images in batches for s in images)}")
    print(table(["batch shapes / captures", "padding share", "batches fitting no bucket"], columns))
    for key in ("given", "picked"):
        if key in result and result[key]["misfit_shapes"]:
            shown = " ".join(f"{h}x{w}" for h, w in result[key]["misfit_shapes"][:12])
            more = len(result[key]["misfit_shapes"]) - 12
            print(f"no bucket of the {key} set holds: {shown}" + (f" ... ({more} more shapes)" if more > 0 else ""))
    if picked:
        print("model = dict(data_preprocessor=dict(buckets=[" + ", ".join(f"({h}, {w})" for h, w in picked) + "]))")
    if args.json:
        from ..checkpoint.files import atomic_write

        with setup_errors(program("buckets.py")):
            atomic_write(args.json, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

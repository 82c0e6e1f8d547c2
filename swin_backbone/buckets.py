"""Shape buckets: a few batch shapes every padded batch is padded up to (docs/shape-buckets.md).

A backbone compiled whole with static shapes and CUDA graphs (``compile=dict(mode='reduce-overhead',
dynamic=False, regions=False)``) compiles and captures one graph per batch shape. mmdet pads each
batch to its largest image (rounded to ``pad_size_divisor``), so multi-scale training produces
dozens of shapes; padding each batch further, to the smallest of a few *buckets* that holds it,
leaves a few graphs. With the images' valid sizes attached (``SwinDetDataPreprocessor``), each
image's features stay exactly those of the image alone, whatever its bucket pads.

A bucket ``(H, W)`` serves both orientations: ``(H, W)`` and ``(W, H)``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

Shape = Tuple[int, int]


def check_buckets(buckets: object, name: str = "buckets") -> Tuple[Shape, ...]:
    """``buckets`` as a tuple of ``(H, W)`` int pairs (each > 0); ``ValueError`` naming ``name`` otherwise."""
    if buckets is None:
        return ()
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise ValueError(f"{name}: expected a list of (height, width) pairs, got {buckets!r}")
    out = []
    for bucket in buckets:
        if (isinstance(bucket, (str, bytes)) or not isinstance(bucket, Sequence) or len(bucket) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bucket)):
            raise ValueError(f"{name}: expected (height, width) pairs of positive ints, got {bucket!r} in {buckets!r}")
        out.append((int(bucket[0]), int(bucket[1])))
    return tuple(out)


def oriented(buckets: Sequence[Shape]) -> Tuple[Shape, ...]:
    """Every bucket in both orientations, smallest area first (ties: in the order given), no repeats."""
    seen, out = set(), []
    for h, w in buckets:
        for shape in ((h, w), (w, h)):
            if shape not in seen:
                seen.add(shape)
                out.append(shape)
    return tuple(sorted(out, key=lambda s: s[0] * s[1]))


def choose_bucket(height: int, width: int, buckets: Sequence[Shape]) -> Optional[Shape]:
    """The smallest-area bucket (either orientation) at least ``height x width``; ``None`` if none holds it."""
    for h, w in oriented(buckets):
        if h >= height and w >= width:
            return (h, w)
    return None

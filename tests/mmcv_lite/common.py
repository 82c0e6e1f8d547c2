"""Shared by the mmcv-lite tests: routing mmcv's layers to one ``_ext``, recording which ops they
call, and pure-torch references written from mmcv's kernels (float64, no torchvision)."""
import math
from collections import defaultdict
from typing import Dict, Set

import torch
import torch.nn.functional as F

from swin_backbone.mmcv_lite import bound_to as use_ext  # noqa: F401
from swin_backbone.mmcv_lite import compiled_ext  # noqa: F401


def lite_ext():
    from swin_backbone.mmcv_lite import ext

    return ext


class Recorder:
    """A ``_ext`` that forwards to ``ext`` and records ``{op name: {device types}}``."""

    def __init__(self, ext) -> None:
        self._ext = ext
        self.calls: Dict[str, Set[str]] = defaultdict(set)

    def __getattr__(self, name):
        fn = getattr(self._ext, name)

        def recorded(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            self.calls[name].add(tensors[0].device.type if tensors else "?")
            return fn(*args, **kwargs)

        return recorded


# ------------------------------------------------------------------------ references
def ref_nms(boxes, scores, iou_threshold, offset=0):
    """Greedy NMS as mmcv's CPU kernel: by descending score, drop boxes with IoU > threshold."""
    b = boxes.double().cpu()
    x1, y1, x2, y2 = b.unbind(1)
    area = (x2 - x1 + offset) * (y2 - y1 + offset)
    suppressed = torch.zeros(len(b), dtype=torch.bool)
    keep = []
    for i in scores.double().cpu().argsort(descending=True).tolist():
        if suppressed[i]:
            continue
        keep.append(i)
        w = (torch.min(x2[i], x2) - torch.max(x1[i], x1) + offset).clamp(min=0)
        h = (torch.min(y2[i], y2) - torch.max(y1[i], y1) + offset).clamp(min=0)
        inter = w * h
        suppressed |= inter / (area[i] + area - inter) > iou_threshold
    return torch.tensor(keep, dtype=torch.long)


def _interp_matrix(coords, size):
    """(len(coords), size): mmcv's bilinear_interpolate along one axis (zero beyond one pixel
    outside, clamped to the border within it)."""
    m = torch.zeros(len(coords), size, dtype=torch.float64)
    for i, c in enumerate(coords):
        if c < -1.0 or c > size:
            continue
        c = max(c, 0.0)
        lo = int(math.floor(c))
        if lo >= size - 1:
            lo = hi = size - 1
            c = float(lo)
        else:
            hi = lo + 1
        frac = c - lo
        m[i, lo] += 1 - frac
        m[i, hi] += frac
    return m


def ref_roi_align(x, rois, out_hw, spatial_scale, sampling_ratio, aligned):
    """mmcv's RoIAlign (average mode), roi by roi; differentiable w.r.t. ``x``."""
    ph, pw = out_hw
    offset = 0.5 if aligned else 0.0
    outs = []
    for r in rois.double().cpu().tolist():
        b = int(r[0])
        x1, y1, x2, y2 = (v * spatial_scale - offset for v in r[1:])
        rw, rh = x2 - x1, y2 - y1
        if not aligned:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        bh, bw = rh / ph, rw / pw
        gh = sampling_ratio if sampling_ratio > 0 else math.ceil(rh / ph)
        gw = sampling_ratio if sampling_ratio > 0 else math.ceil(rw / pw)
        ys = [y1 + i * bh + (j + 0.5) * bh / gh for i in range(ph) for j in range(gh)]
        xs = [x1 + i * bw + (j + 0.5) * bw / gw for i in range(pw) for j in range(gw)]
        my, mx = _interp_matrix(ys, x.shape[2]).to(x.device), _interp_matrix(xs, x.shape[3]).to(x.device)
        v = torch.einsum("yh,chw,xw->cyx", my, x[b].double(), mx)
        outs.append(v.view(x.shape[1], ph, gh, pw, gw).mean((2, 4)))
    return torch.stack(outs)


def ref_modulated_deform_conv(x, offset, mask, weight, bias, stride, padding, dilation, groups, deform_groups):
    """DCNv2 as mmcv's im2col kernel: per kernel tap, bilinear samples (zero outside) at the
    tap's position plus its (dy, dx) offset, times the mask, then a grouped 1x1 contraction."""
    n, c, h, w = x.shape
    co, _, kh, kw = weight.shape
    ho, wo = offset.shape[-2:]
    k = kh * kw
    off = offset.view(n, deform_groups, k, 2, ho, wo)
    m = mask.view(n, deform_groups, k, ho, wo)
    base_y = (torch.arange(ho, device=x.device, dtype=x.dtype) * stride - padding).view(1, 1, ho, 1)
    base_x = (torch.arange(wo, device=x.device, dtype=x.dtype) * stride - padding).view(1, 1, 1, wo)
    xg = x.reshape(n * deform_groups, c // deform_groups, h, w)
    cols = []
    for t in range(k):
        py = base_y + (t // kw) * dilation + off[:, :, t, 0]
        px = base_x + (t % kw) * dilation + off[:, :, t, 1]
        grid = torch.stack([px / (w - 1) * 2 - 1, py / (h - 1) * 2 - 1], -1).view(n * deform_groups, ho, wo, 2)
        s = F.grid_sample(xg, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
        cols.append(s.view(n, deform_groups, c // deform_groups, ho, wo) * m[:, :, t].unsqueeze(2))
    cols = torch.stack(cols, 3).view(n, groups, c // groups, k, ho, wo)
    out = torch.einsum("ngckhw,gock->ngohw", cols, weight.view(groups, co // groups, c // groups, k))
    out = out.reshape(n, co, ho, wo)
    return out if bias is None else out + bias.view(1, -1, 1, 1)


def ref_ms_deform_attn(value, shapes, starts, loc, attn):
    """Multi-scale deformable attention point by point, as mmcv's CUDA kernel: each query and
    head sums, over levels and sampling points, its attention weight times the bilinear sample
    (zero outside the map) of its level's values at ``loc`` x (W, H) - 0.5 (pixel centres).
    ``value`` (bs, keys, heads, dims), ``loc`` (bs, queries, heads, levels, points, 2) as (x, y)
    in [0, 1], ``attn`` (bs, queries, heads, levels, points) -> (bs, queries, heads * dims);
    differentiable w.r.t. all three."""
    bs, _, heads, dims = value.shape
    queries, levels, points = loc.shape[1], loc.shape[3], loc.shape[4]
    rows = []
    for b in range(bs):
        for q in range(queries):
            for h in range(heads):
                acc = value.new_zeros(dims)
                for lvl in range(levels):
                    height, width = (int(v) for v in shapes[lvl])
                    start = int(starts[lvl])
                    level = value[b, start:start + height * width, h].reshape(height, width, dims)
                    for p in range(points):
                        x = loc[b, q, h, lvl, p, 0] * width - 0.5
                        y = loc[b, q, h, lvl, p, 1] * height - 0.5
                        x0, y0 = math.floor(x.item()), math.floor(y.item())
                        sample = value.new_zeros(dims)
                        for yy, wy in ((y0, y0 + 1 - y), (y0 + 1, y - y0)):
                            for xx, wx in ((x0, x0 + 1 - x), (x0 + 1, x - x0)):
                                if 0 <= yy < height and 0 <= xx < width:
                                    sample = sample + wy * wx * level[yy, xx]
                        acc = acc + attn[b, q, h, lvl, p] * sample
                rows.append(acc)
    return torch.stack(rows).reshape(bs, queries, heads * dims)

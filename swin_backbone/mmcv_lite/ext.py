"""A stand-in for mmcv's compiled extension ``mmcv._ext``, written with torchvision.ops and torch.

Each function keeps the signature of the compiled op and its calling convention (results written
into the tensors mmcv passes in, or returned where the compiled op returns them), so mmcv's own
autograd Functions and modules around them run unchanged, on the CPU and on CUDA. Every op
computes in float32 with autocast off and writes back in the caller's dtype: bf16 / fp16 inputs
(``--amp``) work where the compiled CPU kernels refuse them, at float32 accuracy.

:data:`OPS` is the table of what is served. Any other op of mmcv (a name one of mmcv's ops modules
asks ``_ext`` for) resolves to a function that raises :class:`NotCoveredError` naming the op, the
mmcv module that uses it and the remedy; a name that is no op of mmcv is an ``AttributeError``.
Loaded as ``mmcv._ext`` by ``_swin_backbone_mmcv_ext`` (the finder at the end of ``sys.meta_path``),
by file: this module imports nothing of swin_backbone. Its parity with compiled mmcv: docs/mmcv-lite.md.
"""
from __future__ import annotations

import ast
import difflib
import functools
import glob
import os
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torchvision

#: Marks this module as the stand-in (``swin_backbone.mmcv_lite.active``).
IS_SWIN_BACKBONE_LITE = True


class NotCoveredError(RuntimeError):
    """An mmcv op that mmcv-lite plus swin_backbone does not provide."""


def _autocast_off(tensor: torch.Tensor) -> torch.autocast:
    """Autocast off for ``tensor``'s device: the ops below run in float32 whatever the caller's
    autocast region says (their float32 casts would otherwise be undone inside it)."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


def _as_float32(t: torch.Tensor) -> torch.Tensor:
    """Floating tensors as float32; index / label tensors unchanged."""
    return t.float() if t.is_floating_point() else t


# ----------------------------------------------------------------------------------- NMS
def nms(boxes, scores, iou_threshold, offset=0):
    """mmcv's NMS (``boxes`` (N, 4) x1y1x2y2, ``scores`` (N,)): indices kept, by descending
    score. ``offset=1`` (the legacy +1 box size) is torchvision's NMS on boxes one pixel larger.

    Equal scores are visited in the order of mmcv's kernels, which rank with torch's default
    (unstable) sort, where torchvision's NMS sorts stably: ranked here as mmcv ranks, then handed
    to torchvision already sorted, so its stable sort keeps that order. (Ties do occur in training:
    the RPN scores identical proposals alike, and their order decides which RoIs the sampler draws.)"""
    with _autocast_off(boxes):
        scores, order = scores.float().sort(0, descending=True)
        boxes = boxes.float()[order]
        if offset:
            boxes = torch.cat([boxes[:, :2], boxes[:, 2:] + offset], dim=1)
        return order[torchvision.ops.nms(boxes, scores, float(iou_threshold))]


# ------------------------------------------------------------------------------ RoIAlign
def roi_align_forward(input, rois, output, argmax_y, argmax_x, aligned_height, aligned_width,
                      spatial_scale, sampling_ratio, pool_mode, aligned):
    """``input`` (N, C, H, W), ``rois`` (K, 5) (batch index, x1, y1, x2, y2) -> ``output``
    (K, C, aligned_height, aligned_width), written in place. Average pooling only."""
    _require(pool_mode == 1, "roi_align_forward", "pool_mode='max' (only pool_mode='avg' is covered)")
    with _autocast_off(input):
        out = torchvision.ops.roi_align(_as_float32(input), _as_float32(rois), (aligned_height, aligned_width),
                                        spatial_scale, sampling_ratio, aligned)
    output.copy_(out)


def roi_align_backward(grad_output, rois, argmax_y, argmax_x, grad_input, aligned_height,
                       aligned_width, spatial_scale, sampling_ratio, pool_mode, aligned):
    """Gradient of :func:`roi_align_forward` w.r.t. its input, written into ``grad_input``."""
    _require(pool_mode == 1, "roi_align_backward", "pool_mode='max' (only pool_mode='avg' is covered)")
    # RoIAlign is linear in its input: its vector-Jacobian product does not depend on the values.
    with torch.enable_grad(), _autocast_off(grad_output):
        x = torch.zeros(grad_input.shape, dtype=torch.float32, device=grad_input.device, requires_grad=True)
        out = torchvision.ops.roi_align(x, _as_float32(rois), (aligned_height, aligned_width), spatial_scale,
                                        sampling_ratio, aligned)
        (g,) = torch.autograd.grad(out, x, _as_float32(grad_output))
    grad_input.copy_(g)


# ---------------------------------------------------------------------- sigmoid focal loss
def _sigmoid_focal(input, target, weight, gamma, alpha):
    """Per-element sigmoid focal loss, (N, C) from logits (N, C) and labels (N,) (C: background).
    ``weight`` (C,) or empty: a per-class factor, indexed by each row's label."""
    p = input.sigmoid()
    classes = torch.arange(input.size(1), device=input.device)
    onehot = (target.unsqueeze(1) == classes).to(input.dtype)
    logsig = torch.nn.functional.logsigmoid
    pos = -alpha * (1 - p).pow(gamma) * logsig(input)
    neg = -(1 - alpha) * p.pow(gamma) * logsig(-input)
    loss = onehot * pos + (1 - onehot) * neg
    if weight.numel():
        loss = loss * _as_float32(weight)[target.clamp(min=0, max=input.size(1) - 1)].unsqueeze(1)
    return loss


def sigmoid_focal_loss_forward(input, target, weight, output, gamma, alpha):
    with _autocast_off(input):
        output.copy_(_sigmoid_focal(_as_float32(input), target, weight, gamma, alpha))


def sigmoid_focal_loss_backward(input, target, weight, grad_input, gamma, alpha):
    with torch.enable_grad(), _autocast_off(input):
        x = _as_float32(input).detach().requires_grad_(True)
        (g,) = torch.autograd.grad(_sigmoid_focal(x, target, weight, gamma, alpha).sum(), x)
    grad_input.copy_(g)


# -------------------------------------------------------- multi-scale deformable attention
def _levels(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor) -> List[Tuple[int, int]]:
    shapes = [(int(h), int(w)) for h, w in spatial_shapes.tolist()]
    starts = [int(s) for s in level_start_index.tolist()]
    expected = [sum(h * w for h, w in shapes[:i]) for i in range(len(shapes))]
    if starts != expected:  # mmcv's PyTorch path (used below) assumes the levels packed in order
        raise NotCoveredError(_message("ms_deform_attn_forward", f"level_start_index {starts} is not the packed "
                                       f"layout {expected} of value_spatial_shapes {shapes}"))
    return shapes


def _ms_deform_attn(value, shapes, sampling_locations, attention_weights):
    from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch

    return multi_scale_deformable_attn_pytorch(value, shapes, sampling_locations, attention_weights)


def ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                           attention_weights, im2col_step):
    """``value`` (bs, num_keys, heads, dims), ``sampling_locations`` (bs, queries, heads, levels,
    points, 2) in [0, 1], ``attention_weights`` (bs, queries, heads, levels, points) -> output
    (bs, queries, heads * dims), in ``value``'s dtype: mmcv's own PyTorch path (grid_sample)."""
    shapes = _levels(value_spatial_shapes, value_level_start_index)
    with _autocast_off(value):
        out = _ms_deform_attn(_as_float32(value), shapes, _as_float32(sampling_locations), _as_float32(attention_weights))
    return out.to(value.dtype)


def ms_deform_attn_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                            attention_weights, grad_output, grad_value, grad_sampling_loc, grad_attn_weight,
                            im2col_step):
    """Gradients of :func:`ms_deform_attn_forward` (autograd through grid_sample), written into
    ``grad_value``, ``grad_sampling_loc`` and ``grad_attn_weight``."""
    shapes = _levels(value_spatial_shapes, value_level_start_index)
    with torch.enable_grad(), _autocast_off(value):
        inputs = [_as_float32(t).detach().requires_grad_(True) for t in (value, sampling_locations, attention_weights)]
        out = _ms_deform_attn(inputs[0], shapes, inputs[1], inputs[2])
        grads = torch.autograd.grad(out, inputs, _as_float32(grad_output))
    for buf, g in zip((grad_value, grad_sampling_loc, grad_attn_weight), grads):
        buf.copy_(g)


# ------------------------------------------------------------------ modulated deformable conv
def _output_hw(input, weight, stride, padding, dilation):
    return tuple((input.size(2 + d) + 2 * padding[d] - dilation[d] * (weight.size(2 + d) - 1) - 1) // stride[d] + 1
                 for d in range(2))


def _as_mmcv_reads(t: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    """``offset`` / ``mask`` as mmcv's kernels read them: per image, the first C * Ho * Wo values
    of its (C, H, W) block, laid out as (C, Ho, Wo). The same tensor where H, W = Ho, Wo. DyHead
    hands offsets of one pyramid level to the DCN of the next, smaller one (``spatial_conv_high``)."""
    if tuple(t.shape[-2:]) == hw:
        return t
    n, c = t.shape[:2]
    if t.shape[2] * t.shape[3] < hw[0] * hw[1]:
        raise NotCoveredError(_message("modulated_deform_conv_forward", f"offset / mask of spatial size "
                                       f"{tuple(t.shape[-2:])} smaller than the output {hw}"))
    return t.reshape(n, -1)[:, :c * hw[0] * hw[1]].reshape(n, c, hw[0], hw[1])


def _deform_conv(input, weight, bias, offset, mask, stride, padding, dilation):
    hw = _output_hw(input, weight, stride, padding, dilation)
    return torchvision.ops.deform_conv2d(input, _as_mmcv_reads(offset, hw), weight, bias, stride=stride,
                                         padding=padding, dilation=dilation, mask=_as_mmcv_reads(mask, hw))


def _check_dcn_groups(op, input, weight, offset, kernel_h, kernel_w, group, deformable_group):
    _require(input.size(1) == weight.size(1) * group, op,
             f"input channels {input.size(1)} != weight in-channels {weight.size(1)} x group {group}")
    _require(offset.size(1) == 2 * deformable_group * kernel_h * kernel_w, op,
             f"offset channels {offset.size(1)} != 2 x deformable_group {deformable_group} x kernel "
             f"{kernel_h}x{kernel_w}")


def modulated_deform_conv_forward(input, weight, bias, ones, offset, mask, output, columns, kernel_h, kernel_w,
                                  stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                                  deformable_group, with_bias):
    """DCNv2: ``input`` (N, C, H, W), ``offset`` (N, 2 * dg * kh * kw, Ho, Wo) as (dy, dx) pairs,
    ``mask`` (N, dg * kh * kw, Ho, Wo) -> ``output`` (N, C_out, Ho, Wo), written in place
    (torchvision's ``deform_conv2d`` with its mask; ``ones`` / ``columns`` are mmcv's unused buffers)."""
    _check_dcn_groups("modulated_deform_conv_forward", input, weight, offset, kernel_h, kernel_w, group,
                      deformable_group)
    with _autocast_off(input):
        out = _deform_conv(_as_float32(input), _as_float32(weight), _as_float32(bias) if with_bias else None, _as_float32(offset), _as_float32(mask),
                           (stride_h, stride_w), (pad_h, pad_w), (dilation_h, dilation_w))
    output.copy_(out)


def modulated_deform_conv_backward(input, weight, bias, ones, offset, mask, columns, grad_input, grad_weight,
                                   grad_bias, grad_offset, grad_mask, grad_output, kernel_h, kernel_w, stride_h,
                                   stride_w, pad_h, pad_w, dilation_h, dilation_w, group, deformable_group,
                                   with_bias):
    """Gradients of :func:`modulated_deform_conv_forward` (torchvision's backward), written into
    ``grad_input``, ``grad_weight``, ``grad_bias`` (with a bias), ``grad_offset`` and ``grad_mask``."""
    _check_dcn_groups("modulated_deform_conv_backward", input, weight, offset, kernel_h, kernel_w, group,
                      deformable_group)
    with torch.enable_grad(), _autocast_off(input):
        leaves = [_as_float32(t).detach().requires_grad_(True) for t in (input, weight, offset, mask)]
        b: Optional[torch.Tensor] = _as_float32(bias).detach().requires_grad_(True) if with_bias else None
        out = _deform_conv(leaves[0], leaves[1], b, leaves[2], leaves[3], (stride_h, stride_w), (pad_h, pad_w),
                           (dilation_h, dilation_w))
        grads = torch.autograd.grad(out, leaves + ([b] if b is not None else []), _as_float32(grad_output))
    for buf, g in zip((grad_input, grad_weight, grad_offset, grad_mask), grads[:4]):
        buf.copy_(g)
    if with_bias:
        grad_bias.copy_(grads[4])


# ------------------------------------------------------------------------- the table
#: The compiled ops this module serves, by the name mmcv's ops modules ask ``_ext`` for. The one
#: list: what mmcv gets, what :class:`NotCoveredError` counts as missing, what the tests check.
OPS: Dict[str, Callable] = {fn.__name__: fn for fn in (
    nms,
    roi_align_forward,
    roi_align_backward,
    sigmoid_focal_loss_forward,
    sigmoid_focal_loss_backward,
    ms_deform_attn_forward,
    ms_deform_attn_backward,
    modulated_deform_conv_forward,
    modulated_deform_conv_backward,
)}
for _name in OPS:  # served through the table alone (__getattr__): a function left out of it is not served
    del globals()[_name]

_LOAD_EXT = re.compile(r"load_ext\(\s*['\"]_ext['\"]\s*,\s*(\[.*?\])\s*\)", re.S)
_mmcv_ops: Dict[str, str] = {}


def mmcv_ops() -> Dict[str, str]:
    """Every op the installed mmcv's ops modules ask ``_ext`` for, with the module asking
    (``{'nms': 'mmcv.ops.nms', ...}``), read from their ``load_ext('_ext', [...])`` calls."""
    if not _mmcv_ops:
        import mmcv

        folder = os.path.join(os.path.dirname(mmcv.__file__), "ops")
        for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
            with open(path, encoding="utf-8") as f:
                for names in _LOAD_EXT.findall(f.read()):
                    for name in ast.literal_eval(names):
                        _mmcv_ops.setdefault(name, "mmcv.ops." + os.path.basename(path)[:-3])
    return _mmcv_ops


def _require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise NotCoveredError(_message(op, what))


def _message(op: str, what: str = "") -> str:
    """What is not covered, the mmcv module that uses the op, and the remedy. The model layer is
    not named: only walking the caller's stack frames could find it, and the traceback shows it."""
    import mmcv

    used_by = mmcv_ops().get(op)
    detail = f": {what}" if what else ""
    return (f"mmcv op {op!r}{detail} is not covered on mmcv-lite" + (f" (used by {used_by})" if used_by else "")
            + f". swin_backbone gives mmcv-lite {mmcv.__version__} the ops the Swin detectors and segmentors use "
            f"({', '.join(OPS)}; docs/mmcv-lite.md); for this one install full mmcv with compiled ops (pip uninstall "
            "mmcv-lite; then mmcv built for your torch, e.g. `mim install 'mmcv>=2.0,<2.2'`)")


def announce() -> None:
    """The one line saying mmcv's ops run here (through mmengine's logger: stdout, as every
    mmengine log line; stderr is kept for the console scripts' one-line errors). Logged when
    mmcv first calls one of :data:`OPS` (:func:`_first_use`), not when mmcv imports its ops."""
    import mmcv
    from mmengine.logging import print_log

    print_log(f"swin_backbone: mmcv {mmcv.__version__} has no compiled ops (mmcv-lite): its ops run on "
              "torchvision / torch (swin_backbone.mmcv_lite; install full mmcv for any op not covered)",
              logger="current")


#: Whether :func:`announce` has run (once per process).
_announced: List[bool] = []


def _first_use(name: str) -> Callable:
    """``OPS[name]`` that first logs :func:`announce`, once per process. mmcv looks the op up on
    its ``ext_module`` at each call: once announced, the lookups answer the op itself."""
    op = OPS[name]

    @functools.wraps(op)
    def first_use(*args, **kwargs):
        if not _announced:
            _announced.append(True)
            announce()
        return op(*args, **kwargs)

    return first_use


def __getattr__(name: str):
    if name in OPS:
        return OPS[name] if _announced else _first_use(name)
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in mmcv_ops():
        close = difflib.get_close_matches(name, list(mmcv_ops()), n=3)
        raise AttributeError(f"mmcv._ext: {name!r} is no op of mmcv (none of its ops modules asks for it)"
                             + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))

    def not_covered(*args, **kwargs):
        raise NotCoveredError(_message(name))

    not_covered.__name__ = name
    return not_covered

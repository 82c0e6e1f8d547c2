"""A stand-in for mmcv's compiled extension ``mmcv._ext``, written with torchvision.ops and torch.

Each function keeps mmcv's calling convention (outputs written into the tensors mmcv passes in;
mmcv's own autograd Functions and modules around them run unchanged). A name not written here
resolves to a function that raises :class:`NotCoveredError` naming the op, the mmcv layer that
called it and the remedy.
"""
from __future__ import annotations

import sys

import torch
import torchvision

#: Marks this module as the stand-in (``swin_backbone.mmcv_lite.active``).
IS_SWIN_BACKBONE_LITE = True


class NotCoveredError(RuntimeError):
    """An mmcv op that mmcv-lite plus swin_backbone does not provide."""


def nms(boxes, scores, iou_threshold, offset=0):
    """mmcv's NMS: indices kept, by descending score. ``offset=1`` (the legacy +1 box size) is
    the same as torchvision's NMS on boxes one pixel larger."""
    boxes = boxes.float()
    if offset:
        boxes = torch.cat([boxes[:, :2], boxes[:, 2:] + offset], dim=1)
    return torchvision.ops.nms(boxes, scores.float(), float(iou_threshold))


def roi_align_forward(input, rois, output, argmax_y, argmax_x, aligned_height, aligned_width,
                      spatial_scale, sampling_ratio, pool_mode, aligned):
    _require(pool_mode == 1, "roi_align_forward", "pool_mode='max' (only 'avg' is covered)")
    out = torchvision.ops.roi_align(input.float(), rois.float(), (aligned_height, aligned_width),
                                    spatial_scale, sampling_ratio, aligned)
    output.copy_(out)


def roi_align_backward(grad_output, rois, argmax_y, argmax_x, grad_input, aligned_height,
                       aligned_width, spatial_scale, sampling_ratio, pool_mode, aligned):
    _require(pool_mode == 1, "roi_align_backward", "pool_mode='max' (only 'avg' is covered)")
    # RoIAlign is linear in its input: its vector-Jacobian product does not depend on the values.
    with torch.enable_grad():
        x = torch.zeros(grad_input.shape, dtype=torch.float32, device=grad_input.device,
                        requires_grad=True)
        out = torchvision.ops.roi_align(x, rois.float(), (aligned_height, aligned_width),
                                        spatial_scale, sampling_ratio, aligned)
        (g,) = torch.autograd.grad(out, x, grad_output.float())
    grad_input.copy_(g)


def _sigmoid_focal(input, target, weight, gamma, alpha):
    p = input.sigmoid()
    classes = torch.arange(input.size(1), device=input.device)
    onehot = (target.unsqueeze(1) == classes).to(input.dtype)  # target == C: background
    logsig = torch.nn.functional.logsigmoid
    pos = -alpha * (1 - p).pow(gamma) * logsig(input)
    neg = -(1 - alpha) * p.pow(gamma) * logsig(-input)
    loss = onehot * pos + (1 - onehot) * neg
    if weight.numel():
        loss = loss * weight[target.clamp(min=0, max=input.size(1) - 1)].unsqueeze(1)
    return loss


def sigmoid_focal_loss_forward(input, target, weight, output, gamma, alpha):
    output.copy_(_sigmoid_focal(input, target, weight, gamma, alpha))


def sigmoid_focal_loss_backward(input, target, weight, grad_input, gamma, alpha):
    with torch.enable_grad():
        x = input.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(_sigmoid_focal(x, target, weight, gamma, alpha).sum(), x)
    grad_input.copy_(g)


def _require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise NotCoveredError(_message(op, what))


def _caller_layer() -> str:
    """The mmcv op or layer class (or function) whose call reached the stand-in."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("mmcv.ops"):
            owner = frame.f_locals.get("self")
            cls = frame.f_locals.get("cls") or frame.f_locals.get("ctx")
            if owner is not None and isinstance(owner, torch.nn.Module):
                return f"{type(owner).__module__}.{type(owner).__qualname__}"
            if cls is not None:
                return f"{module} ({frame.f_code.co_name})"
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown caller"


def _message(op: str, what: str = "") -> str:
    import mmcv

    detail = f": {what}" if what else ""
    return (f"mmcv op {op!r}{detail} is not covered on mmcv-lite (called by {_caller_layer()}). "
            f"swin_backbone gives mmcv-lite {mmcv.__version__} the ops the Swin detectors and "
            "segmentors use (docs/mmcv-lite.md); for this one install full mmcv with compiled ops "
            "(pip uninstall mmcv-lite; then mmcv built for your torch, e.g. "
            "`mim install 'mmcv>=2.0,<2.2'`)")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def not_covered(*args, **kwargs):
        raise NotCoveredError(_message(name))

    not_covered.__name__ = name
    return not_covered

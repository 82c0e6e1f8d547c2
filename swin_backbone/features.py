"""Feature-map extraction: images in, multi-scale Swin features out (API used by
tools/extract_features.py, and usable from notebooks).

>>> from swin_backbone.features import FeatureExtractor
>>> fx = FeatureExtractor.from_arch('tiny', checkpoint='swin_tiny_patch4_window7_224.pth')
>>> fx = FeatureExtractor.from_arch('v2-tiny', checkpoint='swinv2_tiny_patch4_window8_256.pth')  # Swin V2
>>> feats = fx([image_hwc_uint8])          # list (one per image) of {stage: (C, h, w) tensor}

An image's features never depend on what else is in its batch. On GPUs, with a SwinBackbone
/ SwinV2Backbone that masks its padding (the defaults), images of different sizes share a
batch, padded to the largest and passed with their ``valid_sizes`` (exact: each image's maps
equal those of the image alone, cropped back to its own size). On the CPU, and for other
backbones, a batch holds images of one input size (batching gains nothing on a CPU, and the
padding would cost compute: docs/performance.md).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .model.presets import V2_PREFIX, arch_names, default_window_size, split_arch  # noqa: F401 (public here)

IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

ImageLike = Union[np.ndarray, torch.Tensor]


def to_tensor(image: ImageLike, name: str = "image") -> torch.Tensor:
    """``(H, W, 3)`` uint8 RGB array (``(H, W, 4)``: alpha dropped), ``(H, W)`` grey, or
    ``(3, H, W)`` tensor -> ``(3, H, W)`` float 0..255 (:func:`~swin_backbone.validation.check_image`:
    anything else is a ``ValueError`` naming ``name``; floats in 0..1 get a warning)."""
    from .validation import check_image

    check_image(name, image)
    if isinstance(image, np.ndarray):
        if image.ndim == 2:
            image = np.repeat(image[:, :, None], 3, axis=2)
        image = torch.from_numpy(np.ascontiguousarray(image[:, :, :3])).permute(2, 0, 1)
    return image.float()


def check_device(device: object) -> torch.device:
    """``torch.device(device)`` for ``'cpu'``, ``'cuda'`` or ``'cuda:N'`` that exists here;
    anything else is a ``ValueError`` naming ``device`` (not torch's parser or driver error)."""
    from .validation import fail

    try:
        parsed = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        fail("device", "'cpu', 'cuda' or 'cuda:N'", device)
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            fail("device", "'cpu' (CUDA is not available on this machine)", device)
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            fail("device", f"'cuda' or 'cuda:N' with N < {torch.cuda.device_count()} (the GPUs here)", device)
    elif parsed.type != "cpu":
        fail("device", "'cpu', 'cuda' or 'cuda:N'", device)
    return parsed


def check_stages(stages: object, num_outputs: Optional[int]) -> Optional[List[int]]:
    """``None`` or a list of distinct output indices ``0 <= s < num_outputs`` (``None``:
    unknown until the first forward)."""
    from .validation import fail, is_int

    if stages is None:
        return None
    upper = f" < {num_outputs} (the backbone's outputs)" if num_outputs is not None else ""
    expected = f"None or a non-empty list of distinct output indices >= 0{upper}"
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        fail("stages", expected, stages)
    if any(not is_int(s) or s < 0 or (num_outputs is not None and s >= num_outputs) for s in stages):
        fail("stages", expected, list(stages))
    if len(set(stages)) != len(stages):
        fail("stages", expected + " (each once)", list(stages))
    return [int(s) for s in stages]


def resize_to(image: torch.Tensor, size: Optional[Tuple[int, int]]) -> torch.Tensor:
    """Bilinear resize of a ``(C, H, W)`` image to ``size`` (``None``: keep)."""
    if size is None or tuple(image.shape[-2:]) == tuple(size):
        return image
    return F.interpolate(image[None], size=size, mode="bilinear", align_corners=False)[0]


class FeatureExtractor:
    """Normalises images, batches same-size images, runs a backbone, returns features.

    Args:
        backbone: any module mapping ``(B, 3, H, W)`` to a tuple of NCHW maps
            (SwinBackbone, or a backbone built from an mmdet / mmseg config).
        stages: which outputs to keep, as indices into the backbone's output tuple
            (``None``: all).
        mean, std: per-channel normalisation of 0..255 RGB input (ImageNet by default).
        resize: ``(H, W)`` to resize every image to, or ``None`` to keep each image's size.
        batch_size: images per forward (of mixed sizes where :attr:`mixed_sizes`, else of one size).
        device, dtype: where and in which precision to run (``'fp32'``, ``'bf16'``, ``'fp16'``).
        mixed_sizes: let images of different sizes share a batch (needs a Swin backbone that
            takes exact ``valid_sizes``); ``None``: on GPUs only.
    """

    def __init__(
        self,
        backbone: nn.Module,
        stages: Optional[Sequence[int]] = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        resize: Optional[Tuple[int, int]] = None,
        batch_size: int = 8,
        device: Union[str, torch.device] = "cpu",
        dtype: str = "fp32",
        mixed_sizes: Optional[bool] = None,
    ) -> None:
        from .validation import check_flag, check_int, check_number, fail

        if not isinstance(backbone, nn.Module):
            fail("backbone", "a torch.nn.Module (e.g. SwinBackbone), or use FeatureExtractor.from_arch / from_config",
                 type(backbone).__name__)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            fail("dtype", f"one of {sorted(DTYPES)}", dtype)
        check_int("batch_size", batch_size, minimum=1)
        for name, values in (("mean", mean), ("std", std)):
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != 3:
                fail(name, "3 numbers (R, G, B on the 0..255 scale)", values)
            for i, v in enumerate(values):
                check_number(f"{name}[{i}]", v, positive=name == "std")
        if resize is not None:
            if isinstance(resize, (str, bytes)) or not isinstance(resize, Sequence) or len(resize) != 2:
                fail("resize", "None or (H, W), two ints >= 1", resize)
            for i, v in enumerate(resize):
                check_int(f"resize[{i}]", v, minimum=1)
        if mixed_sizes is not None:
            check_flag("mixed_sizes", mixed_sizes)
        outputs = getattr(backbone, "out_indices", None)
        self.stages = check_stages(stages, len(outputs) if isinstance(outputs, (list, tuple)) else None)
        self.device = check_device(device)
        self.dtype = DTYPES[dtype]
        self.backbone = backbone.to(self.device, self.dtype).eval()
        self.mean = torch.tensor(mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=self.device).view(1, 3, 1, 1)
        self.resize = tuple(resize) if resize else None
        self.batch_size = batch_size
        self._mixed_sizes = mixed_sizes
        if mixed_sizes and not self._exact_valid_sizes():
            raise ValueError(
                "mixed_sizes: expected a SwinBackbone / SwinV2Backbone with mask_padding=True and "
                f"pad_small_map=True (exact valid_sizes), got {type(backbone).__name__}"
                + (f" with mask_padding={backbone.mask_padding}, pad_small_map={backbone.pad_small_map}"
                   if hasattr(backbone, "mask_padding") else "")
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arch(cls, arch: Optional[str] = "tiny", checkpoint: Optional[str] = None,
                  window_size: Optional[int] = None, out_indices: Sequence[int] = (0, 1, 2, 3),
                  embed_dims: Optional[int] = None, depths: Optional[Sequence[int]] = None,
                  num_heads: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                  pretrained_window_sizes: Optional[Union[int, Sequence[int]]] = None,
                  attention: str = "auto", **kwargs) -> "FeatureExtractor":
        """A Swin V1 or V2 preset (+ a checkpoint of any supported format of that version).

        ``arch``: a V1 preset (``'tiny'`` ... ``'large'``), a V2 preset (``'v2-tiny'`` ...
        ``'v2-giant'``) or a published V2 model name (``'swinv2_tiny_window8_256'``, ...):
        :func:`split_arch`, :func:`arch_names`. ``window_size``: default
        :func:`default_window_size` (7, 8, or the published model's). ``embed_dims`` /
        ``depths`` / ``num_heads`` override the preset (``arch=None``: V1, give all three).
        ``pretrained_window_sizes`` (V2 only): the window(s) the checkpoint was pre-trained
        with, for a larger ``window_size`` (see :class:`~swin_backbone.SwinV2Backbone`).
        ``checkpoint``: a file, a state dict, or a URL / ``torchvision://`` / ``open-mmlab://``
        reference as mmengine takes it (fetched once into torch's hub cache,
        :mod:`swin_backbone.checkpoint.remote`).
        Without a checkpoint the weights are random: ``seed`` makes them reproducible
        (every process of a sharded run must build the same model). ``attention``: the
        backbone's attention kernel setting (``'auto'``, ``'sdpa'``).
        """
        from .model.backbone import SwinBackbone
        from .model.v2 import SwinV2Backbone

        version, name = split_arch(arch)
        window = default_window_size(arch) if window_size is None else window_size
        if seed is not None:
            torch.manual_seed(seed)
        common = dict(arch=name, embed_dims=embed_dims, depths=depths, num_heads=num_heads, window_size=window,
                      out_indices=out_indices, drop_path_rate=0.0, attention=attention)
        if version == 2:
            backbone = SwinV2Backbone(pretrained_window_sizes=pretrained_window_sizes, **common)
        elif pretrained_window_sizes is not None:
            raise ValueError(f"pretrained_window_sizes: only for Swin V2 presets ({V2_PREFIX}tiny, ...), "
                             f"got arch={arch!r}")
        else:
            backbone = SwinBackbone(**common)
        if checkpoint:
            _load_for_arch(backbone, checkpoint, arch)
        else:
            backbone.init_weights()
        return cls(backbone, **kwargs)

    @classmethod
    def from_config(cls, config: str, checkpoint: Optional[str] = None, seed: Optional[int] = None,
                    attention: Optional[str] = None, **kwargs) -> "FeatureExtractor":
        """The backbone of an mmdet / mmseg config, with a whole-model or backbone checkpoint
        (without one the weights are random, reproducible with ``seed``); ``attention``
        overrides the config's attention kernel setting."""
        from mmengine.config import Config
        from mmengine.registry import DefaultScope, init_default_scope

        from .mmlab.runner import config_scope

        cfg = Config.fromfile(config)
        scope = config_scope(cfg)
        init_default_scope(scope)
        import swin_backbone  # noqa: F401  (registration)

        registry = __import__(f"{scope}.registry", fromlist=["MODELS"]).MODELS
        backbone_cfg = cfg.model.backbone.copy()
        backbone_cfg.pop("init_cfg", None)
        backbone_cfg.pop("pretrained", None)
        if attention is not None:
            backbone_cfg["attention"] = attention
        if seed is not None:
            torch.manual_seed(seed)
        with DefaultScope.overwrite_default_scope(scope):
            backbone = registry.build(backbone_cfg)
        if checkpoint:
            from .checkpoint import load_checkpoint

            load_checkpoint(backbone, checkpoint)
        return cls(backbone, **kwargs)

    # ------------------------------------------------------------------ running
    def preprocess(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Same-size ``(3, H, W)`` 0..255 images (float or uint8; pinned ones are copied without
        blocking) -> normalised ``(B, 3, H, W)`` batch on the device."""
        on_device = [im.to(self.device, non_blocking=self.device.type == "cuda").float() for im in images]
        batch = torch.stack([resize_to(im, self.resize) for im in on_device])
        return ((batch - self.mean) / self.std).to(self.dtype)

    def _exact_valid_sizes(self) -> bool:
        """Whether the backbone takes per-image ``valid_sizes`` exactly."""
        from .model.backbone import SwinBackbone

        b = self.backbone
        return isinstance(b, SwinBackbone) and b.mask_padding and b.pad_small_map

    @property
    def mixed_sizes(self) -> bool:
        """Whether images of different sizes share batches: asked for (or, by default, on a
        GPU), the backbone takes exact ``valid_sizes``, and images are not resized to one size."""
        wanted = self.device.type != "cpu" if self._mixed_sizes is None else self._mixed_sizes
        return wanted and self.resize is None and self._exact_valid_sizes()

    @torch.inference_mode()
    def run_batch(self, images: Sequence[torch.Tensor]) -> List[Dict[int, torch.Tensor]]:
        """Features of a batch of images: one ``{stage: (C, h, w) float32 cpu tensor}`` per image.

        Images of one size (after ``resize``) run as they are; images of different sizes (only
        where :attr:`mixed_sizes`) are zero-padded to the largest and run with their
        ``valid_sizes``, and each image's maps are cropped back to its own size.
        """
        sizes = [tuple(im.shape[-2:]) for im in images]
        if self.resize is not None or len(set(sizes)) == 1:
            outs = self.backbone(self.preprocess(images))
            crops = None
        else:
            if not self.mixed_sizes:
                raise ValueError(f"images: expected one size per batch for this backbone, got sizes {sizes}")
            height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
            batch = torch.cat([F.pad(self.preprocess([im]), (0, width - w, 0, height - h))
                               for im, (h, w) in zip(images, sizes)])
            outs = self.backbone(batch, valid_sizes=sizes)
            crops = self._crops(sizes)
        if self.stages is not None and max(self.stages) >= len(outs):
            check_stages(self.stages, len(outs))  # a backbone without out_indices: known only now
        keep = self.stages if self.stages is not None else range(len(outs))
        on_cpu = {s: outs[s].float().cpu() for s in keep}  # one copy per stage, not per image
        result = []
        for i in range(len(images)):
            maps = OrderedDict()
            for s in keep:
                m = on_cpu[s][i]
                if crops is not None:
                    m = m[:, : crops[i][s][0], : crops[i][s][1]]
                maps[s] = m.contiguous()
            result.append(maps)
        return result

    def _crops(self, sizes: Sequence[Tuple[int, int]]) -> List[List[Tuple[int, int]]]:
        """Per image, the ``(h, w)`` of each output of the (Swin) backbone for its own size."""
        from .ops.windows import output_size

        b = self.backbone
        per_stage = [output_size(h, w, b.patch_size, b.num_stages) for h, w in sizes]
        return [[stage_sizes[i] for i in b.out_indices] for stage_sizes in per_stage]

    def batches(self, sizes: Sequence[Tuple[int, int]]) -> Iterable[List[int]]:
        """Indices of images (given their ``(H, W)``) grouped into batches: of similar sizes
        (sorted by size, so that little padding is computed) where :attr:`mixed_sizes`, else of
        one input size each, in order of first appearance."""
        if self.mixed_sizes:
            order = sorted(range(len(sizes)), key=lambda i: (tuple(sizes[i]), i))
            for start in range(0, len(order), self.batch_size):
                yield order[start : start + self.batch_size]
            return
        groups: "OrderedDict[Tuple[int, int], List[int]]" = OrderedDict()
        for i, size in enumerate(sizes):
            groups.setdefault(self.resize or tuple(size), []).append(i)
        for idx in groups.values():
            for start in range(0, len(idx), self.batch_size):
                yield idx[start : start + self.batch_size]

    def __call__(self, images: Sequence[ImageLike]) -> List[Dict[int, torch.Tensor]]:
        """Features of ``images`` (a list of arrays / tensors, or a 4-D batch): one
        ``{stage: (C, h, w) float32 cpu tensor}`` per image."""
        from .validation import fail

        if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim != 4:
            fail("images", "a list of images (or a 4-D batch); for one image pass [image]",
                 f"a single {type(images).__name__} of shape {tuple(images.shape)}")
        if isinstance(images, (str, bytes)) or not isinstance(images, Iterable):
            fail("images", "a list of images", type(images).__name__)
        tensors = [to_tensor(im, f"images[{i}]") for i, im in enumerate(images)]
        results: List[Optional[Dict[int, torch.Tensor]]] = [None] * len(tensors)
        for idx in self.batches([tuple(t.shape[-2:]) for t in tensors]):
            for i, feats in zip(idx, self.run_batch([tensors[i] for i in idx])):
                results[i] = feats
        return results  # type: ignore[return-value]


def _load_for_arch(backbone: nn.Module, checkpoint: str, arch: Optional[str]) -> None:
    """Load ``checkpoint`` (any format; V1 or V2 detected from its keys); a checkpoint of the
    other Swin version is refused with the ``arch`` names that would take it."""
    from .checkpoint import CheckpointError, detect_format, load_checkpoint, read_checkpoint, unwrap_state_dict
    from .checkpoint.base import swin_version

    try:
        load_checkpoint(backbone, checkpoint)
    except CheckpointError as err:
        try:
            have = swin_version(detect_format(unwrap_state_dict(read_checkpoint(checkpoint))[0]))
        except Exception:
            raise err from None
        if have == getattr(backbone, "swin_version", 1):
            raise
        hint = (f"a Swin V2 preset ({V2_PREFIX}tiny, {V2_PREFIX}small, ...) or a published V2 name "
                f"(swinv2_tiny_window8_256, ...)" if have == 2 else "a Swin V1 preset (tiny, small, base, large)")
        raise CheckpointError(f"{err}\n(arch={arch!r} builds Swin V{3 - have}; for this checkpoint pass "
                              f"{hint})") from None


def extract_features(images: Sequence[ImageLike], arch: str = "tiny", checkpoint: Optional[str] = None,
                     **kwargs) -> List[Dict[int, torch.Tensor]]:
    """One-call API: features of ``images`` from a Swin V1 / V2 preset (+ checkpoint):
    :meth:`FeatureExtractor.from_arch`'s names."""
    return FeatureExtractor.from_arch(arch, checkpoint, **kwargs)(images)


def mean_pool(features: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
    """One vector per stage: the mean of each ``(C, h, w)`` map over its positions, ``(C,)`` float32."""
    return OrderedDict((s, f.float().mean(dim=(1, 2))) for s, f in features.items())


def pca_rgb(feature: torch.Tensor) -> np.ndarray:
    """First three principal components of a ``(C, h, w)`` map as an ``(h, w, 3)`` uint8 image."""
    c, h, w = feature.shape
    flat = feature.float().reshape(c, h * w).T
    flat = flat - flat.mean(0, keepdim=True)
    k = min(3, c, h * w)
    if h * w > 1 and k > 0:
        _, _, v = torch.linalg.svd(flat, full_matrices=False)
        comps = flat @ v[:k].T
    else:
        comps = torch.zeros(h * w, 0)
    comps = torch.cat([comps, torch.zeros(h * w, 3 - comps.shape[1])], 1)
    lo, hi = comps.min(0).values, comps.max(0).values
    comps = (comps - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    return (comps.reshape(h, w, 3).numpy() * 255).round().astype(np.uint8)


def side_by_side(image: np.ndarray, panels: Sequence[np.ndarray]) -> np.ndarray:
    """The image and each panel upsampled (nearest) to its size, left to right."""
    h, w = image.shape[:2]
    tiles = [image[:, :, :3]]
    for p in panels:
        t = torch.from_numpy(p).permute(2, 0, 1)[None].float()
        tiles.append(F.interpolate(t, size=(h, w), mode="nearest")[0].permute(1, 2, 0).byte().numpy())
    gap = np.full((h, max(2, math.ceil(w / 100)), 3), 255, np.uint8)
    out = []
    for t in tiles:
        out += [t, gap]
    return np.concatenate(out[:-1], axis=1)

"""What decides the features' values (model, weights, preprocessing, dtype): resolved from the
command line and a ``--config``, recorded in OUT_DIR, and compared on a rerun."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from typing import Dict

import torch

from ...checkpoint.remote import fetch, is_reference, resolve
from ...features import IMAGENET_MEAN, IMAGENET_STD, FeatureExtractor
from ...images import LoaderSettings, resolve_reader
from ..common import atomic_write
from .distributed import DistContext

SETTINGS_FILE = "settings.json"


def feature_settings(args: argparse.Namespace, channels: Dict[int, int]) -> dict:
    """What decides the features' values: a rerun into the same OUT_DIR must match it."""
    ckpt = None
    if args.checkpoint:
        path, name = args.checkpoint, os.path.basename(args.checkpoint)
        if is_reference(args.checkpoint):  # a URL: its cached file (downloaded once), named by the URL
            path, name = (fetch(args.checkpoint)[0] if resolve(args.checkpoint)[0] != "mmengine" else None), path
        digest = hashlib.sha256()
        if path is not None:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 23), b""):
                    digest.update(chunk)
        ckpt = dict(file=name, sha256=digest.hexdigest() if path is not None else None)
    model = dict(arch=args.arch, embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                 window_size=args.window_size)
    if args.pretrained_window_sizes is not None:  # (V2 only; absent otherwise, as before V2 existed)
        model["pretrained_window_sizes"] = args.pretrained_window_sizes
    return dict(model=dict(config=os.path.abspath(args.config)) if args.config else model,
                checkpoint=ckpt, random_weights_seed=args.seed if args.random_weights else None,
                stages={str(s): c for s, c in channels.items()}, resize=args.resize, mean=list(args.mean),
                std=list(args.std), dtype=args.dtype, reader=args.reader)


def check_settings(args: argparse.Namespace, ctx: DistContext, settings: dict) -> None:
    """Refuse an OUT_DIR that holds features made with other ``settings`` (unless ``--overwrite``),
    then (rank 0) record these."""
    path = os.path.join(args.out_dir, SETTINGS_FILE)
    if not args.overwrite and os.path.isfile(path):
        with open(path) as f:
            previous = json.load(f)
        current = json.loads(json.dumps(settings))  # (as it would read back: lists for tuples)
        if previous != current:
            diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            raise SystemExit(f"out_dir {args.out_dir!r}: holds features made with other settings ({', '.join(diff)} "
                             f"differ, see {path}); pass --overwrite to redo everything, or use another OUT_DIR")
    ctx.barrier()  # every rank has compared before rank 0 replaces the file
    if ctx.rank == 0:
        atomic_write(path, json.dumps(settings, indent=1).encode())


def build_extractor(args: argparse.Namespace, device: str) -> FeatureExtractor:
    common = dict(stages=args.stages, mean=args.mean, std=args.std, resize=args.resize,
                  batch_size=args.batch_size, device=device, dtype=args.dtype, seed=args.seed)
    if args.config:
        return FeatureExtractor.from_config(args.config, args.checkpoint, attention=args.attention, **common)
    if args.attention is not None:
        common["attention"] = args.attention
    return FeatureExtractor.from_arch(args.arch, args.checkpoint, window_size=args.window_size,
                                      embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                                      pretrained_window_sizes=args.pretrained_window_sizes, **common)


def rank_device(args: argparse.Namespace, ctx: DistContext) -> str:
    """The device this rank runs on: under torchrun with CUDA, cuda:LOCAL_RANK (made current)."""
    device = torch.device(args.device)
    if device.type == "cuda" and ctx.world_size > 1:
        if device.index is not None:
            raise SystemExit(f"--device {args.device}: under torchrun each rank uses cuda:LOCAL_RANK; "
                             "pass --device cuda")
        torch.cuda.set_device(ctx.local_rank)
        return f"cuda:{ctx.local_rank}"
    return args.device


def reader_label(args: argparse.Namespace) -> str:
    """How images were decoded, for the summary: mmcv's loader settings, or the Pillow fallback."""
    if args.reader == "mmcv":
        return f"mmcv ({args.loader.imdecode_backend}, color_type={args.loader.color_type!r}, as LoadImageFromFile)"
    return "Pillow (mmcv not installed: EXIF orientation and conversions as mmcv's)"


def preprocessing(args: argparse.Namespace) -> None:
    """Decoder, loader settings and mean / std: with ``--config``, its test pipeline's
    ``LoadImageFromFile`` and its data preprocessor's (unless --mean / --std are given)."""
    args.reader = resolve_reader(args.reader)
    args.loader = LoaderSettings()
    if args.config:
        from mmengine.config import Config

        from ...images import loader_settings

        cfg = Config.fromfile(args.config)
        args.loader = loader_settings(cfg)
        preprocessor = (cfg.get("model") or {}).get("data_preprocessor") or {}
        if args.mean is None and preprocessor.get("mean") is not None:
            args.mean = [float(v) for v in preprocessor["mean"]]
        if args.std is None and preprocessor.get("std") is not None:
            args.std = [float(v) for v in preprocessor["std"]]
    args.mean = list(IMAGENET_MEAN) if args.mean is None else args.mean
    args.std = list(IMAGENET_STD) if args.std is None else args.std

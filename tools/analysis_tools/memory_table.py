#!/usr/bin/env python
"""Memory per rank of the Swin backbones under DDP and FSDP (docs/large-models.md).

Three parts, each also runnable alone:

* ``computed``: parameters, gradients and AdamW state per rank for Swin-T/B/L, V2-L and V2-G
  (the published giant shape) at 2, 8 and 64 ranks, from the parameter counts of the real
  modules (built on the meta device: no memory, no weights) and fp32 training state
  (4 B parameter + 4 B gradient + 8 B AdamW moments per parameter).
* ``states``: the same, measured: 2 gloo processes on the CPU, the real backbone wrapped by DDP
  or by FSDP (one unit per Swin block, ``use_orig_params=True``), one AdamW step on a small
  image; the bytes of the tensors held afterwards (parameters, gradients, optimizer state,
  each storage counted once) and the growth of the process's allocated memory (glibc
  ``mallinfo2``, which also sees DDP's gradient buckets).
* ``activations``: memory a training forward keeps for the backward, per 1024x1024 image, with
  and without ``with_cp``, measured on the CPU in fp32 (a fresh process per case; allocated
  bytes after the forward minus before it, ``mallinfo2``), and the peak resident set of the
  forward + backward above the state before it (``VmHWM``).

    python tools/analysis_tools/memory_table.py all --json work_dirs/memory.json     # everything (~15 min on 2 cores)
    python tools/analysis_tools/memory_table.py computed
    python tools/analysis_tools/memory_table.py states --arch large v2-large
    python tools/analysis_tools/memory_table.py activations --arch tiny --size 1024

Measured numbers come from this machine's CPU (named in the output); nothing here runs on a GPU.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GIB = 1024**3
#: The backbones of the table: constructor arguments (window as in the recipes: V1 T/B window 7
#: (the shipped configs), Swin-L window 12 (ImageNet-22k 384 weights, configs/*/..._swin-l...),
#: V2-L window 16 from window-12 weights (swinv2_large_window12to16_192to256), V2-G the paper's
#: giant shape (C 512, depths 2-2-42-4), no published dense-prediction weights.
ARCHS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(version=1, arch="tiny", window_size=7),
    "base": dict(version=1, arch="base", window_size=7),
    "large": dict(version=1, arch="large", window_size=12),
    "v2-large": dict(version=2, arch="large", window_size=16, pretrained_window_sizes=(12, 12, 12, 6)),
    "v2-giant": dict(version=2, arch="giant", window_size=16),
}
LABELS = {"tiny": "Swin-T", "base": "Swin-B", "large": "Swin-L", "v2-large": "Swin V2-L", "v2-giant": "Swin V2-G"}
WORLD_SIZES = (2, 8, 64)
#: fp32 training state per parameter: the parameter, its gradient, AdamW's two moments.
BYTES = dict(params=4, grads=4, optimizer=8)


def build(name: str, **kw: Any):
    """The backbone ``name`` of :data:`ARCHS` (``kw``: more constructor arguments)."""
    from swin_backbone import SwinBackbone, SwinV2Backbone

    spec = dict(ARCHS[name])
    cls = SwinV2Backbone if spec.pop("version") == 2 else SwinBackbone
    return cls(**spec, drop_path_rate=0.0, **kw)


def machine() -> str:
    """The CPU model (/proc/cpuinfo), cores and memory of this machine."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB if hasattr(os, "sysconf") else 0
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM"


# ------------------------------------------------------------------------------------ computed
def on_meta():
    """A context that makes the tensor factories build on the meta device (no memory), except
    ``torch.linspace``: the backbone reads its drop-path rates back as numbers."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    class MetaExceptLinspace(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in _device_constructors() and func is not torch.linspace and kwargs.get("device") is None:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    return MetaExceptLinspace()


def block_params(model) -> int:
    """Parameters of the largest Swin block (what one FSDP unit gathers at a time)."""
    from swin_backbone.model.blocks import SwinBlock
    from swin_backbone.model.v2 import SwinBlockV2

    blocks = [m for m in model.modules() if isinstance(m, (SwinBlock, SwinBlockV2))]
    return max(sum(p.numel() for p in m.parameters()) for m in blocks)


def all_block_params(model) -> int:
    """Parameters inside Swin blocks (the per-block FSDP units); the rest is FSDP's root unit."""
    from swin_backbone.model.blocks import SwinBlock
    from swin_backbone.model.v2 import SwinBlockV2

    return sum(p.numel() for m in model.modules() if isinstance(m, (SwinBlock, SwinBlockV2)) for p in m.parameters())


def computed(names: Sequence[str] = tuple(ARCHS), world_sizes: Sequence[int] = WORLD_SIZES) -> List[Dict[str, Any]]:
    """Per backbone: parameter count and fp32 state per rank under DDP and FSDP (FULL_SHARD)
    at each world size, in bytes.

    DDP adds its gradient buckets (``buckets``: a second fp32 copy of the gradients, which DDP
    all-reduces). FSDP adds what it holds unsharded during a step: one block's full parameters and
    gradients at a time (``unit_bytes``) and the root unit's (everything outside the blocks: patch
    embedding, patch merging, norms; FSDP does not free the root's gathered parameters between
    forward and backward: ``root_bytes``)."""
    rows = []
    for name in names:
        with on_meta():
            model = build(name)
        n = sum(p.numel() for p in model.parameters())
        unit = block_params(model)
        root = n - all_block_params(model)
        per_param = sum(BYTES.values())
        row: Dict[str, Any] = dict(arch=name, label=LABELS[name], params=n, largest_block_params=unit,
                                   root_params=root, ddp=dict((k, v * n) for k, v in BYTES.items()),
                                   unit_bytes=8 * unit, root_bytes=8 * root)
        row["ddp"]["buckets"] = BYTES["grads"] * n
        row["ddp"]["total"] = per_param * n + row["ddp"]["buckets"]
        for w in world_sizes:
            shard = -(-n // w)  # FSDP pads each flat parameter to a multiple of the world size
            row[f"fsdp_{w}"] = dict((k, v * shard) for k, v in BYTES.items())
            row[f"fsdp_{w}"]["total"] = per_param * shard + row["unit_bytes"] + row["root_bytes"]
        rows.append(row)
    return rows


def config_params(path: str) -> Dict[str, Any]:
    """Parameters of the whole model a config builds (detector / segmentor: backbone, neck,
    heads), built on the CPU without loading weights."""
    from mmengine.config import Config
    from mmengine.registry import DefaultScope

    import swin_backbone  # noqa: F401  (registers the backbones)

    cfg = Config.fromfile(path)
    scope = cfg.default_scope
    registry = __import__(f"{scope}.registry", fromlist=["MODELS"]).MODELS
    with DefaultScope.overwrite_default_scope(scope):
        model = registry.build(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    backbone = sum(p.numel() for p in model.backbone.parameters())
    crop = _config_crop(cfg)
    return dict(config=path, params=total, backbone_params=backbone, root_params=total - all_block_params(model),
                largest_block_params=block_params(model), fp32_state_bytes=total * sum(BYTES.values()), crop=crop)


def _config_crop(cfg) -> Optional[int]:
    """The training crop's longer side of a config's pipeline (mmseg ``RandomCrop`` / mmdet's
    ``crop_size``), or ``None``."""
    pipeline = cfg.get("train_pipeline") or cfg.train_dataloader.dataset.get("pipeline", [])
    sides = [max(step["crop_size"]) for step in pipeline if isinstance(step, dict) and "crop_size" in step]
    return max(sides) if sides else None


# ------------------------------------------------------------------------------------ measured
def allocated_bytes() -> int:
    """Bytes this process has allocated through malloc (glibc ``mallinfo2``: arenas + mmap)."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def tensor_bytes(tensors, seen: set) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (data pointers; updated)."""
    total = 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _states_rank(rank: int, world: int, port: int, name: str, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    before = allocated_bytes()
    torch.manual_seed(0)
    model = build(name)
    if mode == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from swin_backbone.model.blocks import SwinBlock
        from swin_backbone.model.v2 import SwinBlockV2

        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({SwinBlock, SwinBlockV2}), use_orig_params=True,
                       device_id=torch.device("cpu"))
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(1, 3, 64, 64)
    sum(o.float().mean() for o in wrapped(x)).backward()
    optimizer.step()
    del x
    seen: set = set()
    params = list(wrapped.parameters())
    if mode == "fsdp":
        params += [m._handle.flat_param for m in FSDP.fsdp_modules(wrapped) if m._handle is not None]
    row = dict(params=tensor_bytes(params, seen), grads=tensor_bytes([p.grad for p in params], seen),
               optimizer=tensor_bytes([t for s in optimizer.state.values() for t in s.values()
                                       if torch.is_tensor(t)], seen))
    row["total"] = row["params"] + row["grads"] + row["optimizer"]
    row["allocated"] = allocated_bytes() - before
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def states(names: Sequence[str], world: int = 2) -> List[Dict[str, Any]]:
    """Measured per-rank state bytes (max over ranks) under DDP and FSDP, ``world`` gloo processes."""
    import tempfile

    import torch.multiprocessing as mp

    rows = []
    for name in names:
        row: Dict[str, Any] = dict(arch=name, label=LABELS[name], world_size=world)
        for mode in ("ddp", "fsdp"):
            with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                s.close()
                out = os.path.join(tmp, "rows.json")
                mp.spawn(_states_rank, args=(world, port, name, mode, out), nprocs=world, join=True)
                ranks = json.load(open(out))
            row[mode] = dict((k, max(r[k] for r in ranks)) for k in ranks[0])
            print(f"{LABELS[name]} {mode}: {_gib(row[mode]['total'])} GiB of state per rank, "
                  f"{_gib(row[mode]['allocated'])} GiB allocated", flush=True)
        rows.append(row)
    return rows


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def activation_case(name: str, size: int, with_cp: bool, backward: bool = False, threads: int = 2) -> Dict[str, Any]:
    """One training forward (and with ``backward`` the backward, for the peak) of one ``size`` x
    ``size`` image, fp32 on the CPU (run it in a fresh process: :func:`activations`)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build(name, with_cp=with_cp).train()
    x = torch.randn(1, 3, size, size)
    model(torch.randn(1, 3, 64, 64))  # first-call caches (layouts, plans) outside the measurement
    base = allocated_bytes()
    peak_ok = _reset_peak_rss()
    rss0 = _peak_rss()
    outs = model(x)
    kept = allocated_bytes() - base
    peak = None
    if backward:
        sum(o.mean() for o in outs).backward()
        peak = _peak_rss() - rss0 if peak_ok else None
    return dict(arch=name, label=LABELS[name], size=size, with_cp=with_cp, kept_for_backward=kept,
                peak_rss_fwd_bwd=peak, output_bytes=sum(o.numel() * o.element_size() for o in outs))


def activations(names: Sequence[str], size: int = 1024, backward: bool = False) -> List[Dict[str, Any]]:
    """:func:`activation_case` for each backbone, without and with ``with_cp``, each in a fresh
    process (so that no allocator state carries over); ``backward``: also the peak."""
    rows = []
    for name in names:
        for cp in (False, True):
            call = f"m.activation_case({name!r}, {size}, {cp}, {backward})"
            code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                    f"import memory_table as m; print('ROW', json.dumps({call}))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{name} with_cp={cp}: {proc.stderr[-2000:]}")
            row = json.loads(proc.stdout.split("ROW ", 1)[1])
            print(f"{LABELS[name]} {size}x{size} with_cp={cp}: {_gib(row['kept_for_backward'])} GiB kept for the "
                  f"backward", flush=True)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ what fits
#: Held back on every GPU for the CUDA context, kernels' workspaces and allocator fragmentation.
RESERVE = 2 * GIB
GPUS = (24, 40, 80)


def block_input_bytes(name: str, size: int) -> float:
    """Sum over blocks of one block's input, fp32, one ``size`` x ``size`` image: what
    ``with_cp`` keeps per block (used only to scale a measured backbone to an unmeasured one)."""
    from swin_backbone.model.presets import resolve_arch

    spec = ARCHS[name]
    values, _ = resolve_arch(spec["arch"], spec["version"])
    tokens = (size // 4) ** 2
    return sum(d * values["embed_dims"] * 2**i * tokens / 4**i * 4 for i, d in enumerate(values["depths"]))


def _activations_at(acts: Dict[tuple, float], arch: str, cp: bool, size: int) -> Optional[tuple]:
    """``(bytes per image, how)``: measured at ``size``, or measured at another size and scaled by
    the token count (a Swin block's activations grow with its tokens: windowed attention is linear
    in them), or ``None``."""
    if (arch, cp, size) in acts:
        return acts[(arch, cp, size)], "measured"
    for (a, c, s), value in sorted(acts.items(), key=lambda kv: -kv[0][2]):
        if a == arch and c == cp:
            return value * (size / s) ** 2, f"scaled from {s}x{s}"
    return None


def fits(result: Dict[str, Any], images: int = 2, size: int = 1024) -> List[Dict[str, Any]]:
    """Per model (the configs' whole models at their recipe's crop, else ``size``; V2-G's backbone
    alone at ``size``) and ``with_cp``: GiB per GPU for ``images`` training images under DDP and
    FSDP at 8 / 64 ranks: the fp32 training state per rank (DDP: + its gradient buckets; FSDP: the
    shard + one gathered block + the root unit, parameters and gradients) + the backbone's measured
    activations per image x ``images`` (:func:`_activations_at`; V2-G: V2-L's scaled by
    :func:`block_input_bytes`) + :data:`RESERVE`. The neck's and heads' activations are not included."""
    acts = {(r["arch"], r["with_cp"], r["size"]): r["kept_for_backward"] for r in result.get("activations", [])}
    for (arch, cp, s), value in list(acts.items()):
        if arch == "v2-large":
            scale = block_input_bytes("v2-giant", s) / block_input_bytes("v2-large", s)
            acts.setdefault(("v2-giant", cp, s), value * scale)
    backbones = {r["arch"]: r for r in result.get("computed", [])}
    models = []
    for r in result.get("configs", []):
        name = os.path.basename(r["config"])
        arch = "v2-large" if "swinv2" in name else "large"
        label = f"{'Cascade Mask R-CNN' if 'cascade' in name else 'UPerNet'} {LABELS[arch]}"
        crop = r.get("crop") if "cascade" not in name else None  # mmdet's 3x crops are not square: keep size
        models.append((label, arch, r["params"], r.get("root_params"), crop or size))
    if "v2-giant" in backbones:
        b = backbones["v2-giant"]
        models.append(("Swin V2-G, backbone alone", "v2-giant", b["params"], b.get("root_params"), size))
    rows = []
    for label, arch, params, root, side in models:
        if arch not in backbones:
            continue
        state = params * sum(BYTES.values())
        unit = backbones[arch]["unit_bytes"]
        root_bytes = 8 * (root if root is not None else backbones[arch].get("root_params", 0))
        for cp in (False, True):
            found = _activations_at(acts, arch, cp, side)
            if found is None:
                continue
            act = images * found[0] + RESERVE
            row: Dict[str, Any] = dict(model=label, arch=arch, with_cp=cp, size=side, activations=found[1],
                                       estimated_activations=arch == "v2-giant")
            row["ddp"] = state + BYTES["grads"] * params + act
            for w in (8, 64):
                row[f"fsdp_{w}"] = -(-state // w) + unit + root_bytes + act
            rows.append(row)
    return rows


def traffic(params: int, nodes: int = 2, gpus_per_node: int = 8, dtype_bytes: int = 4) -> List[Dict[str, Any]]:
    """Bytes each node sends over the inter-node network per training step (and receives: the same),
    at the lower bound of ring / tree collectives, for ``params`` fp32 parameters (``dtype_bytes``: of
    what is communicated) on ``nodes`` x ``gpus_per_node`` ranks:

    * FULL_SHARD over all ranks: two all-gathers of the parameters (forward; backward, after the
      forward freed them) and one reduce-scatter of the gradients, each moving ``(nodes - 1) / nodes``
      of the model across the node boundary;
    * HYBRID_SHARD (shard within a node, replicate across nodes): the all-gathers and the
      reduce-scatter stay within the node; the nodes all-reduce the gradient shards (each rank its
      ``1 / gpus_per_node``, all the node's ranks together the whole model): ``2 (nodes - 1) / nodes``;
    * DDP: one all-reduce of the gradients, the same inter-node volume as HYBRID_SHARD.

    Also the state per rank each shards over (``shard_ranks``)."""
    size = params * dtype_bytes
    cross = (nodes - 1) / nodes
    return [
        dict(strategy="FULL_SHARD", inter_node=3 * cross * size, shard_ranks=nodes * gpus_per_node),
        dict(strategy="HYBRID_SHARD", inter_node=2 * cross * size, shard_ranks=gpus_per_node),
        dict(strategy="DDP", inter_node=2 * cross * size, shard_ranks=1),
    ]


# ------------------------------------------------------------------------------------ output
def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def markdown(result: Dict[str, Any]) -> str:
    """The tables of docs/large-models.md from :func:`main`'s result."""
    lines = []
    if result.get("computed"):
        head = ["backbone", "params", "DDP, any ranks"] + [f"FSDP, {w} ranks" for w in WORLD_SIZES] + [
            "largest block, gathered"]
        head.insert(-1, "root unit, gathered")
        lines += ["Computed: fp32 parameters + gradients + AdamW state per rank, GiB. DDP: + its gradient buckets "
                  "(a second copy of the gradients). FSDP: the rank's shard + one Swin block's parameters and "
                  "gradients gathered in full (last column; with backward prefetch two blocks at a time) + the root "
                  "unit's (patch embedding, merging, norms: gathered for the whole step)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in result["computed"]:
            cells = [r["label"], f"{r['params'] / 1e6:.0f} M", _gib(r["ddp"]["total"])]
            cells += [_gib(r[f"fsdp_{w}"]["total"]) for w in WORLD_SIZES]
            cells += [_gib(r.get("root_bytes")), _gib(r["unit_bytes"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if result.get("configs"):
        lines += ["Computed: whole models (backbone + neck + heads), parameters, FSDP's root unit (all outside the "
                  "Swin blocks: embeddings, merging, norms, neck, heads; unsharded during the whole step) and fp32 "
                  "training state (DDP, per rank, without its buckets; FSDP divides it by the ranks)", "",
                  "| config | params | backbone | root unit | fp32 state, GiB |", "|---|---|---|---|---|"]
        for r in result["configs"]:
            root = r.get("root_params")
            lines.append(f"| {os.path.basename(r['config'])} | {r['params'] / 1e6:.0f} M | "
                         f"{r['backbone_params'] / 1e6:.0f} M | {'-' if root is None else f'{root / 1e6:.0f} M'} | "
                         f"{_gib(r['fp32_state_bytes'])} |")
        lines.append("")
        nodes, gpus = 2, 8
        lines += [f"Computed: the 2-node recipes ({nodes} nodes x {gpus} GPUs), bytes each node sends (and receives) "
                  "over the inter-node network per training step, fp32 (tools/analysis_tools/memory_table.py `traffic`: the lower "
                  "bound of ring collectives), and the ranks the training state is sharded over", "",
                  "| config | FULL_SHARD | HYBRID_SHARD | DDP | HYBRID_SHARD saves | state per rank, HYBRID_SHARD |",
                  "|---|---|---|---|---|---|"]
        for r in result["configs"]:
            t = {row["strategy"]: row for row in traffic(r["params"], nodes, gpus)}
            full, hybrid = t["FULL_SHARD"]["inter_node"], t["HYBRID_SHARD"]["inter_node"]
            lines.append(f"| {os.path.basename(r['config'])} | {_gib(full)} GiB | {_gib(hybrid)} GiB | "
                         f"{_gib(t['DDP']['inter_node'])} GiB | {1 - hybrid / full:.0%} | "
                         f"{_gib(r['fp32_state_bytes'] / gpus)} GiB (1/{gpus}; FULL_SHARD 1/{nodes * gpus}) |")
        lines.append("")
    if result.get("states"):
        head = ["backbone", "strategy", "params", "grads", "AdamW state", "sum", "process allocated"]
        lines += ["Measured, 2 gloo processes on the CPU, per rank (max over ranks), GiB", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in result["states"]:
            for mode in ("ddp", "fsdp"):
                m = r[mode]
                lines.append("| " + " | ".join([r["label"], mode.upper()] + [_gib(m[k]) for k in (
                    "params", "grads", "optimizer", "total", "allocated")]) + " |")
        lines.append("")
    if result.get("activations"):
        lines += ["Measured on the CPU, fp32, one image, training forward: kept for the backward (with --peak: "
                  "/ peak resident memory above the start during forward + backward), GiB", "",
                  "| backbone | input | without with_cp | with with_cp |", "|---|---|---|---|"]
        by = {}
        for r in result["activations"]:
            by.setdefault((r["label"], r["size"]), {})[r["with_cp"]] = r
        for (label, size), cases in by.items():
            cells = [_gib(c["kept_for_backward"]) + ("" if c["peak_rss_fwd_bwd"] is None else
                                                      f" / {_gib(c['peak_rss_fwd_bwd'])}")
                     for c in (cases.get(False), cases.get(True)) if c]
            lines.append(f"| {label} | {size}x{size} | " + " | ".join(cells) + " |")
        lines.append("")
    rows = fits(result)
    if rows:
        lines += [f"Computed: GiB per GPU for 2 training images (the size column): fp32 training state of the whole "
                  f"model (DDP: + its gradient buckets; FSDP: the rank's shard + one gathered block + the root unit) + "
                  f"2 x the backbone's activations per image as measured on the CPU in fp32 (at another size: scaled "
                  f"by the tokens) + {RESERVE // GIB} GiB reserve; the neck's and heads' activations are not included. "
                  f"In brackets, the GPUs ({' / '.join(map(str, GPUS))} GB) it fits on", "",
                  "| model | size | with_cp | DDP | FSDP, 8 ranks | FSDP, 64 ranks |", "|---|---|---|---|---|---|"]
        for r in rows:
            cells = []
            for key in ("ddp", "fsdp_8", "fsdp_64"):
                ok = [str(g) for g in GPUS if r[key] <= g * GIB]  # a "40 GB" GPU has 40 GiB
                cells.append(f"{_gib(r[key])} ({', '.join(ok) + ' GB' if ok else 'fits none'})")
            est = " (activations: V2-L's, scaled)" if r["estimated_activations"] else ""
            how = "" if r["activations"] == "measured" else f" ({r['activations']})"
            lines.append(f"| {r['model']}{est} | {r['size']}x{r['size']}{how} | {'on' if r['with_cp'] else 'off'} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Machine: {result['machine']}; torch {result['torch']}; commit {result.get('commit', '?')}.")
    return "\n".join(lines)


def _commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or "?"
    except OSError:
        return "?"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["computed", "states", "activations", "all", "report"])
    parser.add_argument("--arch", nargs="+", choices=list(ARCHS), help="backbones (default: each part's own)")
    parser.add_argument("--size", type=int, default=1024, help="activations: the square input's side")
    parser.add_argument("--config", nargs="+", default=[],
                        help="computed: also the whole models of these mmdet / mmseg configs (backbone + neck + heads)")
    parser.add_argument("--peak", action="store_true",
                        help="activations: run the backward too and report the peak resident memory (slow)")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--merge", nargs="+", default=[],
                        help="report: the --json files of earlier runs, merged into one set of tables")
    args = parser.parse_args(argv)
    import torch

    result: Dict[str, Any] = dict(machine=machine(), torch=torch.__version__, commit=_commit())
    for path in args.merge:
        with open(path) as f:
            result.update({k: v for k, v in json.load(f).items() if v})
    if args.what in ("computed", "all"):
        result["computed"] = computed(args.arch or tuple(ARCHS))
        result["configs"] = [config_params(path) for path in args.config]
    if args.what in ("states", "all"):  # V2-G is computed only: 3 B parameters do not fit here twice
        result["states"] = states(args.arch or ("tiny", "base", "large", "v2-large"))
    if args.what in ("activations", "all"):
        result["activations"] = activations(args.arch or ("tiny", "base", "large", "v2-large"), args.size,
                                           args.peak)
    print(markdown(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

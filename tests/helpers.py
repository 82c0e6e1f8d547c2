"""Helpers shared by test modules (fixtures are in conftest.py), and the table of newer-torch
features the compatibility suites skip on (:data:`FEATURES`). A test module imports what it
shares from here, never from another test module."""
import glob
import json
import os
import socket
import subprocess
import sys
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from swin_backbone import torch_compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A tiny Swin: real structure (four stages of two blocks), 16 channels; fast on a CPU.
TINY = dict(arch=None, embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), drop_path_rate=0.0)


def small_arch(**kw):
    """A fast Swin config for tests: real structure, fewer channels and blocks."""
    cfg = dict(arch=None, embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16), drop_path_rate=0.0)
    cfg.update(kw)
    return cfg


def randomize(model, std=0.1, position_mlp="cpb_mlp.2.weight"):
    """Non-trivial norms, biases, relative position bias tables and Swin V2 logit scales and
    position-bias MLP outputs (``position_mlp``: the parameter's name ending), so any layout
    error shows in the features; the model in eval mode, returned."""
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table") or (p.dim() == 1 and name.endswith("bias")):
                p.normal_(std=std)
            elif name.endswith("logit_scale"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 5.0))  # some above log(100): the clamp matters
            elif name.endswith(position_mlp):
                p.normal_(std=0.5)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, std)
    return model


def timm_stages(ref, x):
    """timm stage outputs ``(B, H, W, C)`` (no norm)."""
    y = ref.patch_embed(x)
    outs = []
    for layer in ref.layers:
        y = layer(y)
        outs.append(y)
    return outs


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's own rendezvous: never a fixed number, which a
    concurrent run or a lingering socket can hold)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- device syncs
class DeviceSyncs(TorchDispatchMode):
    """Records what would make the host wait for a device: reads of device values
    (``nonzero``, ``item``, ...), device -> CPU copies, and blocking CPU -> device copies."""

    READS = {"nonzero", "_local_scalar_dense", "equal", "is_nonzero", "masked_select", "unique_consecutive",
             "_unique2", "unique_dim"}

    def __init__(self):
        super().__init__()
        self.syncs = []  # op names
        self.copies = []  # non_blocking of each CPU -> device copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        devices = {t.device.type for t in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if (name in self.READS or func is torch.ops.aten.repeat_interleave.Tensor) and devices - {"cpu"}:
            self.syncs.append(name)
        if name == "_to_copy" and kwargs.get("device") is not None:
            src, dst = args[0].device.type, torch.device(kwargs["device"]).type
            if src != "cpu" and dst == "cpu":
                self.syncs.append("copy to cpu")
            elif src == "cpu" and dst != "cpu":
                self.copies.append(kwargs.get("non_blocking", False))
        if name == "copy_" and args[0].device != args[1].device:
            if args[0].device.type == "cpu":
                self.syncs.append("copy to cpu")
            else:
                self.copies.append(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return func(*args, **kwargs)

    def assert_none(self, copies=None):
        """No sync; every CPU -> device copy non-blocking (``copies`` of them, if given).

        ``torch.tensor(..., device=d)`` copies below the dispatcher's Python layer, unseen
        here: counting the copies catches those too."""
        assert not self.syncs, f"host-device syncs: {self.syncs}"
        assert all(self.copies), f"blocking CPU -> device copies (non_blocking of each): {self.copies}"
        if copies is not None:
            assert len(self.copies) == copies, f"CPU -> device copies: {self.copies}"


# ------------------------------------------------------------- swin-extract-features runs
#: swin-extract-features arguments for a tiny random backbone.
EXTRACT_ARGS = ["--embed-dims", "16", "--depths", "1", "1", "1", "1", "--num-heads", "1", "2", "4", "8",
                "--random-weights", "--no-progress", "--batch-size", "2"]
SIZES = [(40, 56), (33, 61), (40, 56), (64, 48), (40, 56), (33, 61), (29, 29), (40, 56)]


def write_images(root) -> None:
    """8 readable images in 4 sizes (a nested folder, PNG and JPEG), one broken JPEG and one
    truncated PNG."""
    rng = np.random.RandomState(0)
    os.makedirs(root / "nested", exist_ok=True)
    for i, size in enumerate(SIZES):
        image = Image.fromarray(rng.randint(0, 255, size + (3,), dtype=np.uint8))
        image.save(root / ("nested" if i % 3 == 0 else ".") / f"img{i}.{'jpg' if i % 2 else 'png'}")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    good = ((root / "img0.png") if (root / "img0.png").exists() else (root / "nested" / "img0.png")).read_bytes()
    (root / "truncated.png").write_bytes(good[: len(good) // 3])


def features(out) -> dict:
    """``{image: {stage: array}}`` of every map the index lists, loaded from disk."""
    index = json.load(open(out / "index.json"))
    result = {}
    for row in index["features"]:
        assert row["image"] not in result or row["stage"] not in result[row["image"]], "an image listed twice"
        arr = np.load(out / row["file"])[row["key"]] if row["key"] else np.load(out / row["file"])
        assert list(arr.shape) == row["shape"]
        result.setdefault(row["image"], {})[row["stage"]] = arr
    return result


def pooled(out) -> dict:
    """``{image: {stage: vector}}`` from every pooled shard the index lists (each image once)."""
    index = json.load(open(out / "index.json"))
    result = {}
    for entry in index["pooled"]:
        with np.load(out / entry["file"]) as z:
            images = z["images"].tolist()
            assert len(images) == entry["images"]
            for j, image in enumerate(images):
                assert image not in result, f"{image} in two shards"
                result[image] = {int(k[5:]): z[k][j] for k in z.files if k.startswith("stage")}
    return result


def assert_same_features(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for image in a:
        assert a[image].keys() == b[image].keys()
        for s in a[image]:
            np.testing.assert_allclose(a[image][s], b[image][s], rtol=1e-4, atol=1e-5, err_msg=f"{image} stage {s}")


# ------------------------------------------------------- training runs of the toy configs
FAST = [
    "train_dataloader.num_workers=0",
    "train_dataloader.persistent_workers=False",
    "val_dataloader.num_workers=0",
    "val_dataloader.persistent_workers=False",
    "test_dataloader.num_workers=0",
    "test_dataloader.persistent_workers=False",
    "train_dataloader.batch_size=2",
]


def iters(n):
    return [f"train_cfg.max_iters={n}", f"train_cfg.val_interval={n}", f"default_hooks.checkpoint.interval={n // 2}"]


def run_tool(args, toy_data, extra_env=None):
    env = dict(os.environ, TOY_DATA_ROOT=toy_data, OMP_NUM_THREADS="1")
    env.update(extra_env or {})
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout + proc.stderr


def scalars(work_dir):
    from swin_backbone.tools.runner import read_metrics

    return read_metrics(work_dir)


def launch(args, toy_data, nnodes=1, env=None, timeout=600):
    """``bash args`` once per node (NNODES / NODE_RANK set, the last node first); every node's
    output, after all succeeded."""
    base = dict(os.environ, TOY_DATA_ROOT=toy_data, OMP_NUM_THREADS="1", PYTHON=sys.executable,
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NNODES=str(nnodes),
                SINGLE_HOST_NODES="1", **(env or {}))  # every "node" on this machine
    procs = {}
    try:
        for node in reversed(range(nnodes)):
            procs[node] = subprocess.Popen(["bash"] + args, cwd=ROOT, env=dict(base, NODE_RANK=str(node)),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outs = [procs[node].communicate(timeout=timeout)[0] for node in range(nnodes)]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for node, out in enumerate(outs):
        assert procs[node].returncode == 0, f"node {node} of {nnodes}: {' '.join(args)}\n{out[-6000:]}"
    return outs


def losses(work, names=("loss",)):
    """``{iteration: {name: value}}`` of the training rows logged under ``work`` (the losses;
    ``names``: the prefixes of the values to take)."""
    return {row["iter"]: {k: v for k, v in row.items() if k.startswith(names)}
            for row in scalars(work) if "iter" in row and "loss" in row}


def assert_losses_close(got, expected, rtol):
    assert sorted(got) == sorted(expected) and got
    for it in expected:
        assert got[it].keys() == expected[it].keys()
        for name, value in expected[it].items():
            assert got[it][name] == pytest.approx(value, rel=rtol, abs=1e-6), f"iteration {it}, {name}"


# -------------------------------------------------------------------- the shipped configs
CONFIG_ROOT = os.path.join(ROOT, "swin_backbone", ".mim", "configs")  # ./configs links here
CONFIGS = sorted(p for p in glob.glob(os.path.join(CONFIG_ROOT, "**", "*.py"), recursive=True) if "_base_" not in p)


def build_config(path, edit: Optional[Callable[[object], None]] = None):
    """A shipped config and the model its default scope's registry builds from it (``edit``: a
    change made to the config first)."""
    from mmengine.config import Config
    from mmengine.registry import DefaultScope

    cfg = Config.fromfile(path)
    if edit is not None:
        edit(cfg)
    scope = cfg.default_scope
    registry = __import__(f"{scope}.registry", fromlist=["MODELS"]).MODELS
    with DefaultScope.overwrite_default_scope(scope):
        model = registry.build(cfg.model)
    return cfg, model


# ---------------------------------------------------------------------------- torch features
#: Each newer-torch feature the package uses: ``name -> (test, what it needs, what happens
#: without it)``. The table of docs/compatibility.md; tests that need a feature carry
#: ``@pytest.mark.torch_feature(name)`` and skip, naming it, where it is missing (conftest.py).
FEATURES: Dict[str, Tuple[Callable[[], bool], str, str]] = {
    "sdpa_scale": (
        lambda: torch_compat.SDPA_HAS_SCALE,
        "scaled_dot_product_attention(scale=) (torch >= 2.1)",
        "the query is pre-scaled before SDPA (equal to rounding)",
    ),
    "compile": (
        lambda: torch_compat.compile_unsupported_reason() is None,
        "torch.compile on this Python (torch >= 2.1 on Python 3.11, >= 2.4 on 3.12)",
        "torch.compile raises in torch itself; the model runs eagerly",
    ),
    "compile_one_graph": (
        lambda: torch_compat.compile_unsupported_reason() is None and torch_compat.torch_version() >= (2, 4),
        "torch.compile tracing a whole forward as one graph (seen on torch 2.14; torch 2.1's dynamo "
        "splits it into 80-96 graphs; versions between not tested, so torch >= 2.4 is assumed)",
        "torch.compile runs the forward as several graphs (graph breaks: slower compiled code)",
    ),
    "cpu_flash_sdpa": (
        lambda: hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
        "a flash SDPA kernel for CPU tensors (newer torch: not in 2.0 or 2.1)",
        "CPU attention runs SDPA's math kernel (same results, slower and more memory)",
    ),
    "export": (
        torch_compat.has_export,
        "torch.export.export with torch.export.Dim (torch >= 2.2)",
        "torch.export is missing in torch itself; TorchScript tracing / eager are unaffected",
    ),
    "onnx_dynamo": (
        torch_compat.onnx_export_has_dynamo,
        "torch.onnx.export(dynamo=True) (torch >= 2.5)",
        "the TorchScript-based ONNX exporter (torch.onnx.export without dynamo=True) is what remains",
    ),
    "load_mmap": (
        torch_compat.load_supports_mmap,
        "torch.load(mmap=True) (torch >= 2.1)",
        "files are read into memory instead of memory-mapped (same tensors)",
    ),
}


def has_feature(name: str) -> bool:
    """Whether the installed torch has feature ``name`` (a key of :data:`FEATURES`)."""
    return bool(FEATURES[name][0]())


def missing_reason(name: str) -> str:
    """One sentence: what ``name`` needs, the installed torch, and what happens instead."""
    _, needs, instead = FEATURES[name]
    return f"needs {needs}; the installed torch is {torch.__version__} (Python {sys.version.split()[0]}): {instead}"

"""How the developer benchmark measures (``tools/analysis_tools/benchmark.py`` picks the rows), over
the pieces it shares with ``swin-benchmark`` (:mod:`swin_backbone.tools.benchmark`: the models,
the steps, the interleaved rounds and their summary):

* the models compared: Swin-T as ours and mmdet's with the same weights, timm's and
  torchvision's Swin-T, and Swin V2-T as ours, timm's and torchvision's with the same weights
  (every peer library is optional: a builder returns the models that are installed);
* one step of a model (eval, training), under planner overrides, TF32 or ``torch.compile``;
* wall time in interleaved rounds, FLOPs, the machine's dense matmul rate, which attention ran;
* peak training memory, each model in a fresh process (``benchmark.py --memory-child``);
* the printed rows, the ``--json`` file rewritten as each row finishes, and the machine.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # (run from a checkout: its package)
    sys.path.insert(0, ROOT)

import swin_backbone  # noqa: E402
from swin_backbone import SwinV2Backbone, load_checkpoint, ops  # noqa: E402
from swin_backbone.checkpoint.files import atomic_write  # noqa: E402
from swin_backbone.tools import benchmark as user  # noqa: E402
from swin_backbone.tools.benchmark import (build_pair, build_peers, eval_step, installed, interleave,  # noqa: E402,F401
                                           step_peak_cuda, summarize, sync, timed, train_step)
from swin_backbone.torch_compat import has_fp32_precision  # noqa: E402

#: The peer libraries the rows compare with: ``swin-benchmark``'s, and mmseg for ``--upernet``.
PEERS: Dict[str, Tuple[str, str]] = {
    **user.PEERS, "timm": ("timm's rows (and the Swin V2 rows' reference weights)", "pip install timm"),
    "mmseg": ("--upernet (an mmseg UPerNet)", "pip install 'swin-backbone[mmseg]'"),
}
#: This harness's script: the memory children run it.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark.py")

#: timm's Swin V2 model that the V2 rows compare with (ours: ``SwinV2Backbone('tiny', window_size=8)``).
V2_TIMM = "swinv2_tiny_window8_256"


def build_v2(device: str, size: Sequence[int], peers: bool = True, seed: int = 0) -> Dict[str, torch.nn.Module]:
    """Swin V2-T window 8: ours, timm's (features_only, built for ``size``) and torchvision's
    ``swin_v2_t`` features, where installed, all with the same weights and no stochastic depth.

    The weights are timm's random initialisation: loaded into ours through the checkpoint
    loader (timm-v2 format; our stage 1-3 output norms, which a classification model lacks,
    stay unit LayerNorms) and into torchvision through our torchvision-v2 writer.
    """
    from swin_backbone.checkpoint.formats_v2 import ours_v2_to_torchvision

    torch.manual_seed(seed)
    ours = SwinV2Backbone("tiny", window_size=8, drop_path_rate=0.0)
    models: Dict[str, torch.nn.Module] = {"ours": ours}
    try:
        import timm
    except ImportError:
        timm = None
    if timm is not None:
        full = timm.create_model(V2_TIMM, pretrained=False, drop_path_rate=0.0)
        load_checkpoint(ours, full.state_dict(), logger=None)
        if peers:
            feats = timm.create_model(V2_TIMM, pretrained=False, features_only=True, img_size=tuple(size),
                                      strict_img_size=False, drop_path_rate=0.0)
            state = {k.replace("layers.", "layers_", 1): v for k, v in full.state_dict().items()
                     if k.startswith(("patch_embed.", "layers."))}
            feats.load_state_dict(state, strict=True)
            models["timm"] = feats
    else:
        ours.init_weights()
    if peers:
        try:
            from torchvision.models import swin_v2_t
            from torchvision.ops import StochasticDepth
        except ImportError:
            swin_v2_t = None
        if swin_v2_t is not None:
            tv = swin_v2_t(weights=None)
            _, unexpected = tv.load_state_dict(ours_v2_to_torchvision(ours.state_dict()), strict=False)
            if unexpected:
                raise RuntimeError(f"torchvision swin_v2_t: unexpected keys from our converter: {unexpected[:5]}")
            for m in tv.modules():
                if isinstance(m, StochasticDepth):
                    m.p = 0.0
            models["torchvision"] = tv.features
    return {k: m.to(device) for k, m in models.items()}


# ---------------------------------------------------------------------------------- steps
def with_switches(fn: Callable[[], None], changes: Dict[str, object]) -> Callable[[], None]:
    """``fn`` run under the planner overrides ``changes`` (see :func:`ops.override`)."""
    def run():
        with ops.override(**changes):
            fn()

    return run


def marked_step(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` begun with ``torch.compiler.cudagraph_mark_step_begin()``: a model compiled whole with
    CUDA graphs, timed beside our regions (which mark each forward; once a step has been marked,
    CUDA graph trees begin steps only at marks)."""
    def run():
        torch.compiler.cudagraph_mark_step_begin()
        fn()

    return run


def tf32_flags() -> List[Tuple[object, str, object, object]]:
    """``(namespace, attribute, on, off)`` of torch's TF32 switches for fp32 cuBLAS matmuls and
    cuDNN convolutions: ``fp32_precision`` ('tf32' / 'ieee') where torch has it (on torch >= 2.9
    reading or writing the legacy ``allow_tf32`` raises once ``fp32_precision`` was set), else
    ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    conv = getattr(torch.backends.cudnn, "conv", None)
    return [
        (matmul, "fp32_precision", "tf32", "ieee") if has_fp32_precision(matmul)
        else (matmul, "allow_tf32", True, False),
        (conv, "fp32_precision", "tf32", "ieee") if conv is not None and has_fp32_precision(conv)
        else (torch.backends.cudnn, "allow_tf32", True, False),
    ]


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 for fp32 matmuls and convolutions on or off (CUDA; flags only elsewhere), restored on exit."""
    flags = tf32_flags()
    saved = [getattr(ns, name) for ns, name, _, _ in flags]
    try:
        for ns, name, on, off in flags:
            setattr(ns, name, on if enabled else off)
        yield
    finally:
        for (ns, name, _, _), value in zip(flags, saved):
            setattr(ns, name, value)


def compile_model(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """``torch.compile(model, **kwargs)`` (one place, so a test can stand in for it on a CPU)."""
    return torch.compile(model, **kwargs)


def regional_model(model: torch.nn.Module, **options) -> torch.nn.Module:
    """A copy of the backbone ``model`` in its compiled mode (``compile=True``: its regions
    compiled, ``options`` as its ``compile`` dict: ``torch.compile``'s, ``dynamic=True`` unless
    given, and ``regions=False`` to compile it whole); one place, as :func:`compile_model`."""
    from ..model.compiled import compile_backbone
    from ..validation import check_compile

    regional = copy.deepcopy(model)
    regional.compile_options = check_compile(options or True)
    compile_backbone(regional, regional.compile_options)
    return regional


def dtype_tag(dtype: Optional[torch.dtype], fp32: str = "fp32") -> str:
    """A row's dtype in its key and label: ``fp32`` (no autocast) or the autocast dtype's."""
    return fp32 if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


# ------------------------------------------------------------------------------ measuring
def host_and_step(fn: Callable[[], None], device: str, iters: int) -> Tuple[float, float]:
    """Medians over ``iters`` calls of ``(host, step)`` seconds: until ``fn``'s Python returns (on
    CUDA its kernels launched, not waited for), and until its kernels are done. Equal: the GPU
    waits on the host (fewer, cheaper host calls are what speed the step up)."""
    host, step = [], []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
        sync(device)
        step.append(time.perf_counter() - start)
    return statistics.median(host), statistics.median(step)


def count_flops(model, x) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(x)
    return counter.get_total_flops()


def matmul_step(device: str, n: int = 2048) -> Callable[[], None]:
    """Four dense fp32 ``n x n`` matmuls (``run.flops`` = ``8 n^3``): the attainable peak."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def run():
        for _ in range(4):
            a @ b

    run.flops = 4 * 2 * n**3  # type: ignore[attr-defined]
    return run


def sdpa_kernels(model, x, autocast_dtype, train: bool, changes: Optional[Dict[str, object]] = None,
                 **kwargs) -> dict:
    """Which attention one forward (``train``: one forward + backward) of ``model(x, **kwargs)``
    ran, under the planner overrides ``changes``, from one torch.profiler run:

    * ``kernels``: names of the SDPA / attention ops and kernels;
    * ``sdpa_calls``: SDPA calls (forward backend ops ``aten::_scaled_dot_product_*``: one per
      call, also where a compiled graph calls a backend directly);
    * ``inductor_triton_launches``: GPU launches of inductor's Triton kernels (``triton_*``);
    * ``constant_pad_nd`` / ``copy_``: those ops in the whole step, and ``*_in_sdpa``: inside
      SDPA calls (the fused CUDA kernels copy a mask whose non-last strides are not multiples
      of 8 on every call; nested ops count too: a pad's own copy is also a copy).
    """
    from torch.autograd import DeviceType
    from torch.profiler import profile

    step = with_switches((train_step if train else eval_step)(model, x, autocast_dtype, **kwargs), changes or {})
    with profile() as prof:
        step()
        sync(x.device.type)
    events = prof.events()
    counts = {"constant_pad_nd": 0, "copy_": 0, "constant_pad_nd_in_sdpa": 0, "copy_in_sdpa": 0}
    for e in events:
        if e.name in ("aten::constant_pad_nd", "aten::copy_"):
            op = e.name[len("aten::"):]
            counts[op] += 1
            parent = e.cpu_parent
            while parent is not None and "scaled_dot_product" not in parent.name:
                parent = parent.cpu_parent
            counts[op.rstrip("_") + "_in_sdpa"] += parent is not None
    on_device = [e.name for e in events if e.device_type != DeviceType.CPU]
    names = {e.key for e in prof.key_averages()}
    return {
        "step": "forward+backward" if train else "forward",
        "kernels": sorted(n for n in names if "scaled_dot_product" in n or "attention" in n.lower()
                          or n.startswith(("fmha", "flash"))),
        "sdpa_calls": sum(e.name.startswith("aten::_scaled_dot_product_") and not e.name.endswith("_backward")
                          for e in events),
        "inductor_triton_launches": sum(n.startswith("triton_") for n in on_device),
        **counts,
    }


# ---------------------------------------------------------------------------- peak memory
def memory_child(name: str, device: str, batch: int, size: Sequence[int], changes: Dict[str, object],
                 dtype: Optional[str]) -> None:
    """Run in a fresh process: peak memory of one fwd+bwd of ``name``'s model (``v2:NAME``: a
    Swin V2 row's; timm, torchvision: their Swin-T) under the planner overrides ``changes``,
    beyond the model and input, printed as one JSON line."""
    if name.startswith("v2:"):  # a Swin V2 row's model
        name = name[3:]
        models = build_v2(device, size, peers=name != "ours")
    elif name in ("timm", "torchvision"):
        models = build_peers(device, size)
    else:
        models = build_pair(device)
    model = models[name]
    model.train()  # (mmdet's train() returns None: no chaining)
    del models
    x = torch.randn(batch, 3, *size, device=device)
    step = with_switches(train_step(model, x, getattr(torch, dtype) if dtype else None), changes)
    if device == "cuda":
        step()  # warm-up: cuBLAS / autotuning workspaces are not activations
        peak = step_peak_cuda(step)
    else:
        gc.collect()
        base = _reset_peak_rss()
        step()
        peak = _peak_rss() - base
    print(json.dumps({"peak_bytes": int(peak)}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0) and return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def _peak_rss() -> int:
    return _status_kb("VmHWM")


def peak_memory(name: str, device: str, batch: int, size: Sequence[int], variant: Optional[str] = None,
                dtype: Optional[str] = None) -> int:
    """Peak memory of one training step of ``name`` on ``batch x 3 x H x W`` under the ablation
    ``variant`` (a name of ``benchmark.ABLATIONS``), in a fresh process (on CUDA after this
    process returned its cached blocks, which would compete for the GPU)."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    cmd = [sys.executable, SCRIPT, "--memory-child", name, "--device", device,
           "--batch", str(batch), "--memory-size", str(size[0]), str(size[1])]
    if variant:
        cmd += ["--ablate-variant", variant]
    if dtype:
        cmd += ["--memory-dtype", dtype]
    # Large blocks straight from / back to the OS (mmap), so RSS follows live tensors instead
    # of glibc's retained free memory.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    root = os.path.dirname(os.path.dirname(os.path.abspath(swin_backbone.__file__)))  # (the folder holding it)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


# ----------------------------------------------------------------------- rows and results
def memory_row(label: str, mem: Dict[str, int]) -> dict:
    """Print and return the peak-memory row: ours, and mmdet's with the ratio where it ran."""
    if "mmdet" not in mem:
        print(f"{label}: ours {mem['ours'] / 2**20:.0f} MiB")
        return {"ours_bytes": mem["ours"]}
    ratio = mem["ours"] / mem["mmdet"]
    print(f"{label}: ours {mem['ours'] / 2**20:.0f} MiB, mmdet {mem['mmdet'] / 2**20:.0f} MiB, ratio {ratio:.2f}x")
    return {"ours_bytes": mem["ours"], "mmdet_bytes": mem["mmdet"], "ratio": ratio}


class SavedResults(dict):
    """The results, rewritten to ``path`` (JSON) whenever a row is added: a run cut short (a
    time limit) keeps the rows it finished."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.save()

    def save(self) -> None:
        atomic_write(self.path, json.dumps(self, indent=2).encode())


def environment() -> Dict[str, object]:
    """The machine and the versions a GPU figure is recorded with (``--report``, the GPU script)."""
    info: Dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "swin_backbone": swin_backbone.__version__,
    }
    for lib in ("mmdet", "mmcv", "timm", "torchvision", "triton"):  # (triton: inductor's compiler)
        info[lib] = getattr(importlib.import_module(lib), "__version__", None) if installed(lib) else None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        version = ctypes.c_int()
        try:
            ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        except (OSError, AttributeError):
            version.value = 0
        info.update(gpu=props.name, driver=version.value or None, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info

"""Peak training memory of one model, each in a fresh process (``swin-benchmark --memory-child``):
peak RSS growth on the CPU, peak allocated CUDA memory on a GPU."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Dict, Optional, Sequence

import torch

import swin_backbone

from . import builders
from .steps import train_step, with_switches


def memory_child(name: str, device: str, batch: int, size: Sequence[int], changes: Dict[str, object],
                 dtype: Optional[str]) -> None:
    """Run in a fresh process: peak memory of one fwd+bwd of ``name``'s model (``v2:NAME``: a
    Swin V2 row's) under the planner overrides ``changes``, beyond the model and input, printed
    as one JSON line."""
    if name.startswith("v2:"):  # a Swin V2 row's model
        name = name[3:]
        models = builders.build_v2(device, size, peers=name != "ours")
    else:
        models = builders.build_pair(device)
    model = models[name]
    model.train()  # (mmdet's train() returns None: no chaining)
    del models
    x = torch.randn(batch, 3, *size, device=device)
    step = with_switches(train_step(model, x, getattr(torch, dtype) if dtype else None), changes)
    if device == "cuda":
        step()  # warm-up: cuBLAS / autotuning workspaces are not activations
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
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
    ``variant`` (a name of :data:`~.ablation.ABLATIONS`), in a fresh process (on CUDA after this
    process returned its cached blocks, which would compete for the GPU)."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    cmd = [sys.executable, "-m", "swin_backbone.tools.benchmark", "--memory-child", name, "--device", device,
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

"""``swin-benchmark --ablate``: each of the backbone's optimisations (a planner switch) off in
turn, against the defaults, with the same weights in the same interleaved rounds."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from swin_backbone import ops

from . import builders, memory
from .measure import interleave
from .steps import eval_step, train_step, with_switches

#: ``--ablate`` variants: name -> planner switches (see swin_backbone.ops.planner.Switches).
ABLATIONS: Dict[str, Dict[str, object]] = {
    "no SDPA (matmul attention)": dict(sdpa=False),
    "no recompute attention (autograd)": dict(recompute_attention=False),
    "no selective checkpointing of the MLP": dict(save_memory=False),
    "no CPU row chunks": dict(chunk_bytes=0),
    "row chunks x0.5": dict(chunk_bytes="half"),
    "row chunks x2": dict(chunk_bytes="double"),
}

#: ``--ablate --v2`` variants (names of :data:`ABLATIONS`): every one reaches SwinV2Backbone
#: through the same ``ops`` functions as V1. sdpa and recompute_attention: ``WindowAttentionV2``
#: runs ``ops.window_attention`` (the plan's kernel) on V1's stage layouts; save_memory:
#: ``ops.cosine_qkv`` and ``ops.mlp_residual`` (norm after); chunk_bytes: the latter's inference
#: path, the recompute attention's backward and ``ops.output_nchw``.
V2_ABLATIONS: Tuple[str, ...] = tuple(ABLATIONS)


def switches(name: Optional[str]) -> Dict[str, object]:
    """Planner overrides of an ablation variant (``None``: the defaults)."""
    if name is None:
        return {}
    if name not in ABLATIONS:
        raise ValueError(f"--ablate-variant: expected one of {sorted(ABLATIONS)}, got {name!r}")
    changes = dict(ABLATIONS[name])
    if changes.get("chunk_bytes") in ("half", "double"):
        base = ops.planner.cpu_chunk_bytes()
        changes["chunk_bytes"] = base // 2 if changes["chunk_bytes"] == "half" else base * 2
    return changes


def ablation_variants(names: Sequence[str], only: Optional[Sequence[str]]) -> List[str]:
    """The variants of ``names`` whose name contains a word of ``--only`` (all of them without it)."""
    chosen = list(names) if not only else [name for name in names if any(o in name for o in only)]
    if only and not chosen:
        raise ValueError(f"--only: expected words of the variant names {sorted(names)}, got {only}")
    return chosen


def run_ablations(args, results: dict) -> None:
    """``--ablate``: the ablation of SwinBackbone (Swin-T, key ``ablation``), and with ``--v2``
    that of SwinV2Backbone (:func:`~.builders.build_v2`'s "ours", key ``v2_ablation``; ``--v2 only``: just
    that), each with the variants ``--only`` chose."""
    device = args.device
    v1 = ablation_variants(ABLATIONS, args.only) if args.v2 != "only" else None
    v2 = ablation_variants(V2_ABLATIONS, args.only) if args.v2 else None  # (checked before anything runs)
    if v1 is not None:
        run_ablation(args, results, builders.build_pair(device)["ours"], v1)
    if v2 is not None:
        v2_model = builders.build_v2(device, args.eval_size, peers=False)["ours"]
        run_ablation(args, results, v2_model, v2, memory_name="v2:ours", key="v2_ablation",
                     title="Swin V2 ablation of SwinV2Backbone tiny, window 8")


def run_ablation(args, results: dict, model: torch.nn.Module, chosen: Sequence[str], memory_name: str = "ours",
                 key: str = "ablation", title: str = "ablation") -> None:
    """Each optimisation of ``chosen`` (names of :data:`ABLATIONS`) off in turn against the
    defaults, for ``model``: eval, training and memory effects (memory: of ``memory_name``'s
    model in :func:`~.memory.memory_child`), printed under ``title`` and stored as ``results[key]``."""
    device = args.device
    eh, ew = args.eval_size
    ts = args.train_size
    x_eval = torch.randn(1, 3, eh, ew, device=device)
    x_train = torch.randn(2, 3, ts, ts, device=device)
    variants: List[Optional[str]] = [None, *chosen]
    label = {v: v or "defaults" for v in variants}
    model.eval()
    eval_times = interleave({label[v]: with_switches(eval_step(model, x_eval), switches(v)) for v in variants},
                            device, args.iters, args.warmup)
    model.train()
    train_times = interleave({label[v]: with_switches(train_step(model, x_train), switches(v)) for v in variants},
                             device, args.iters, args.warmup)
    peaks = {} if args.skip_memory else {label[v]: memory.peak_memory(memory_name, device, 2, (ts, ts), v)
                                          for v in variants}
    base = "defaults"
    rows = {}
    print(f"\n{title} (each optimisation off; effect = time or memory without it / with it - 1; "
          f"eval 1x3x{eh}x{ew}, train 2x3x{ts}x{ts}, {args.iters} interleaved rounds)")
    print(f"{'variant':40s} {'eval':>9s} {'train':>9s} {'memory':>9s}")
    for v in variants:
        name = label[v]
        row = {
            "eval_s": statistics.median(eval_times[name]),
            "train_s": statistics.median(train_times[name]),
            "eval_effect": statistics.median(t / b for t, b in zip(eval_times[name], eval_times[base])) - 1,
            "train_effect": statistics.median(t / b for t, b in zip(train_times[name], train_times[base])) - 1,
        }
        if peaks:
            row["peak_bytes"] = peaks[name]
            row["memory_effect"] = peaks[name] / peaks[base] - 1
        rows[name] = row
        mem = f"{100 * row['memory_effect']:+8.1f}%" if peaks else "       -"
        if v is None:
            mem = f"{peaks[name] / 2**20:7.0f}MB" if peaks else mem
            print(f"{name:40s} {row['eval_s'] * 1e3:7.0f}ms {row['train_s'] * 1e3:7.0f}ms {mem}")
        else:
            print(f"{name:40s} {100 * row['eval_effect']:+8.1f}% {100 * row['train_effect']:+8.1f}% {mem}")
    results[key] = {"eval_size": [eh, ew], "train_size": ts, "rows": rows,
                    "samples": {"eval": eval_times, "train": train_times}}

"""Helpers shared by tools/train.py and tools/test.py (mmengine Runner, mmdet or mmseg).

The scope (mmdet or mmseg) comes from the config's ``default_scope``, which the libraries'
base configs set, so one script serves both.
"""
from __future__ import annotations

import os
import os.path as osp
import sys
from contextlib import contextmanager
from typing import Optional

import torch
from mmengine.config import Config

from ..mmlab.runner import config_scope, require_checkpoint_match
from .common import one_line


def add_common_args(parser) -> None:
    """Arguments shared by tools/train.py and tools/test.py (as in mmdet / mmseg)."""
    from mmengine.config import DictAction

    parser.add_argument(
        "--cfg-options", nargs="+", action=DictAction, help="override config settings, key=value (mmengine syntax)"
    )
    parser.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none", help="job launcher")
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or --local_rank.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)


def program(script: str) -> str:
    """The name a tool's one-line errors give it: the installed command as typed (``swin-train``),
    else the checkout's script (``tools/train.py``, also under ``python -m``)."""
    name = osp.basename(sys.argv[0])
    return name if name.startswith("swin-") else f"tools/{script}"


def parse_tool_args(parser, argv=None):
    """``parser``'s arguments and :func:`add_common_args`', parsed from ``argv``."""
    add_common_args(parser)
    return parser.parse_args(argv)


@contextmanager
def tool_setup(args, prog: str):
    """A tool's setup: :func:`prepare_environment`, then its config read (:func:`load_config`)
    and yielded under :func:`setup_errors` (``prog``): the tool's own checks of its arguments,
    in the ``with`` block, end in the same one-line error (exit status 1)."""
    prepare_environment(args.local_rank)
    with setup_errors(prog):
        yield load_config(args.config, args.cfg_options, args.work_dir, args.launcher)


def load_config(
    path: str,
    cfg_options: Optional[dict] = None,
    work_dir: Optional[str] = None,
    launcher: str = "none",
) -> Config:
    """Read a config, apply ``--cfg-options`` and pick the work dir like mmdet / mmseg do.

    ``path``: a file, or a shipped config by its ``swin_backbone::`` name (``swin_backbone::toy/...``).
    Work dir priority: the CLI, then the config's ``work_dir``, then
    ``./work_dirs/<config name>``.
    """
    path = shipped_config(path)
    if not osp.isfile(path):
        raise FileNotFoundError(f"config {path!r}: {'a folder' if osp.isdir(path) else 'no such file'}; "
                                "expected an mmdet / mmseg config file (.py)")
    if work_dir is not None and osp.exists(work_dir) and not osp.isdir(work_dir):
        raise NotADirectoryError(f"--work-dir {work_dir!r}: a file; expected a folder (created if missing)")
    try:
        cfg = Config.fromfile(path)
    except Exception as err:  # syntax errors, unknown base configs: one line naming the file
        raise ValueError(f"config {path!r}: cannot be read ({type(err).__name__}: {one_line(err)})"
                         + _missing_libraries(path)) from err
    cfg.launcher = launcher
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get("work_dir") is None:
        cfg.work_dir = osp.join("./work_dirs", osp.splitext(osp.basename(path))[0])
    config_scope(cfg)
    return cfg


def _missing_libraries(path: str) -> str:
    """What to install where ``path`` or a base it names by relative path inherits ``mmdet::`` /
    ``mmseg::`` configs of a library that is not installed ('' otherwise)."""
    import importlib.util
    import re

    named, todo, seen = set(), [osp.abspath(path)], set()
    while todo:
        current = todo.pop()
        if current in seen or not osp.isfile(current):
            continue
        seen.add(current)
        with open(current, encoding="utf-8") as f:
            text = f.read()
        named.update(re.findall(r"['\"](mmdet|mmseg)::", text))
        todo += [osp.join(osp.dirname(current), p) for p in re.findall(r"['\"]([^'\":]+\.py)['\"]", text)]
    return "".join(f"; it inherits {lib}'s configs and {lib} is not installed: pip install "
                   f"'swin-backbone[{lib}-lite]' (no mmcv) or 'swin-backbone[{lib}]' (mmcv installed)"
                   for lib in sorted(named) if importlib.util.find_spec(lib) is None)


def shipped_config(path: str) -> str:
    """The file of a shipped config named ``swin_backbone::<path>`` (as in a ``_base_``), in the
    installed package's ``.mim/configs``; any other path unchanged."""
    from ..mmlab import CONFIG_SCOPE

    prefix = CONFIG_SCOPE + "::"
    if not path.startswith(prefix):
        return path
    package = osp.dirname(osp.dirname(osp.abspath(__file__)))
    return osp.join(package, ".mim", "configs", path[len(prefix):])


def setup_errors(prog: str):
    """Errors of a tool's setup (arguments, config): ``SystemExit`` with one line naming them
    (exit status 1), instead of a traceback."""
    return _SetupErrors(prog)


class _SetupErrors:
    def __init__(self, prog: str) -> None:
        self.prog = prog

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if err is not None and isinstance(err, (OSError, ValueError)):
            raise SystemExit(f"{self.prog}: error: {one_line(err)}") from err
        return False


def prepare_environment(local_rank: int = 0) -> None:
    """Process-wide setup both tools need before building a Runner."""
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local_rank)
    # (Registers SwinBackbone even without custom_imports, and reads --resume and load_from
    # through the package's inert unpickler: swin_backbone.checkpoint.mmengine_schemes.)
    import swin_backbone  # noqa: F401


def enable_amp(cfg: Config) -> None:
    """Mixed precision as ``--amp`` does in mmdet / mmseg.

    On CUDA: ``AmpOptimWrapper`` with dynamic loss scaling (fp16). Without CUDA, mmengine's
    AmpOptimWrapper refuses to run, so CPU training uses bf16 autocast (no loss scaling
    needed) with :class:`~swin_backbone.mmlab.optim.BF16AutocastOptimWrapper` (registered by
    ``import swin_backbone``).
    """
    if torch.cuda.is_available():
        cfg.optim_wrapper.type = "AmpOptimWrapper"
        cfg.optim_wrapper.loss_scale = "dynamic"
    else:
        cfg.optim_wrapper.type = "BF16AutocastOptimWrapper"


def resume_settings(cfg: Config, resume: Optional[str]) -> None:
    """``--resume`` (latest checkpoint in the work dir) or ``--resume PATH``."""
    if resume == "auto":
        cfg.resume = True
        cfg.load_from = None
    elif resume is not None:
        cfg.resume = True
        cfg.load_from = resume


def trigger_visualization(cfg: Config, show: bool, show_dir: Optional[str], wait_time: float = 2.0) -> None:
    """Turn on the scope's VisualizationHook, as mmdet's / mmseg's test.py do."""
    hooks = cfg.get("default_hooks", {})
    if "visualization" not in hooks:
        raise RuntimeError("--show/--show-dir need a VisualizationHook in default_hooks (visualization=...)")
    hook = hooks["visualization"]
    hook["draw"] = True
    if show:
        hook["show"] = True
        hook["wait_time"] = wait_time
    if show_dir:
        if config_scope(cfg) == "mmdet":
            hook["test_out_dir"] = show_dir
        else:
            cfg.visualizer["save_dir"] = show_dir


def _replace_norm_type(node, old: str, new: str) -> int:
    count = 0
    if isinstance(node, dict):
        if node.get("type") == old:
            node["type"] = new
            count += 1
        for value in node.values():
            count += _replace_norm_type(value, old, new)
    elif isinstance(node, (list, tuple)):
        for value in node:
            count += _replace_norm_type(value, old, new)
    return count


def setup_cpu_distributed(cfg: Config) -> None:
    """Make mmengine's ``pytorch`` launcher work without CUDA (gloo, CPU DDP).

    mmengine 0.10.7 calls ``torch.cuda.set_device``, defaults to nccl and passes
    ``device_ids=[LOCAL_RANK]`` to DDP, all of which fail on a CPU-only machine. Here the
    process group is initialised with gloo first (the Runner then skips its own init), DDP
    gets ``device_ids=None``, and SyncBN (CUDA-only in torch) becomes BN.
    """
    if cfg.get("launcher", "none") == "none" or torch.cuda.is_available():
        return
    import torch.distributed as dist
    from mmengine.logging import print_log

    if cfg.launcher == "slurm":
        slurm_environment()
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    cfg.env_cfg = dict(cfg.get("env_cfg", {}), dist_cfg=dict(backend="gloo"))
    cfg.model_wrapper_cfg = dict(
        type="MMDistributedDataParallel",
        device_ids=None,
        broadcast_buffers=False,
        find_unused_parameters=cfg.get("find_unused_parameters", False),
    )
    if _replace_norm_type(cfg.model, "SyncBN", "BN"):
        print_log("CPU distributed run: SyncBN replaced by BN (torch's SyncBN needs CUDA)", logger="current")


def slurm_environment() -> None:
    """The ``env://`` variables of a SLURM task, as mmengine's ``_init_dist_slurm`` sets them
    (``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` =
    ``SLURM_LOCALID``, ``MASTER_ADDR`` = the job's first node unless set, ``MASTER_PORT`` 29500
    unless set). mmengine does this itself on GPUs; on the CPU its ``torch.cuda.set_device`` fails,
    so :func:`setup_cpu_distributed` sets them and starts gloo before the Runner."""
    import subprocess

    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST") if k not in os.environ]
    if missing:
        raise RuntimeError(f"--launcher slurm: {', '.join(missing)} not set; expected a task started by srun "
                           "(tools/slurm_train.sh, tools/slurm_test.sh)")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ["SLURM_NODELIST"]
        os.environ["MASTER_ADDR"] = subprocess.getoutput(f"scontrol show hostname {nodes} | head -n1").strip()
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def check_shared_work_dir(work_dir: str) -> bool:
    """Every rank of a distributed job sees the same ``work_dir`` (a shared file system), or a
    ``RuntimeError`` on every rank naming the ranks that do not.

    mmengine writes ``last_checkpoint`` (what ``--resume`` reads), prunes old checkpoints and saves
    full checkpoints on rank 0 only: with a work dir local to each node, nodes after the first would
    resume from scratch. Rank 0 writes a token file, every rank reads it in its own ``work_dir``.
    Returns whether it checked: not without a process group, or in one process."""
    import socket
    import uuid

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    if dist.get_world_size() == 1:
        return True
    rank = dist.get_rank()
    name = [f".shared-work-dir-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    token = name[0]
    if rank == 0:
        os.makedirs(work_dir, exist_ok=True)
        with open(osp.join(work_dir, token), "w") as f:
            f.write(token)
    dist.barrier()
    path = osp.join(work_dir, token)
    try:
        with open(path) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname(), osp.abspath(work_dir)))
    dist.barrier()  # everyone has read it
    if rank == 0:
        os.remove(path)
    blind = [(r, host, where) for r, (ok, host, where) in enumerate(views) if not ok]
    if blind:
        shown = "; ".join(f"rank {r} on {host} ({where})" for r, host, where in blind[:4])
        raise RuntimeError(
            f"work_dir {work_dir!r}: not the same folder on every node: {len(blind)} rank(s) do not see the file "
            f"rank 0 ({views[0][1]}) wrote there: {shown}. A job of several nodes needs its work_dir on a file "
            "system all nodes share (NFS, Lustre, ...): mmengine saves checkpoints and last_checkpoint on rank 0, "
            "and --resume on the other nodes would start from scratch. Give --work-dir a shared path")
    return True


def build_runner(cfg: Config):
    """Runner from the config (or the registry's runner if ``runner_type`` is set)."""
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    if "runner_type" not in cfg:
        return Runner.from_cfg(cfg)
    return RUNNERS.build(cfg)


def rank_zero_test_json(runner) -> None:
    """The test metrics' ``<log_dir>/<timestamp>.json`` written by rank 0 alone.

    mmengine's ``LoggerHook.after_test_epoch`` logs the metrics and dumps them from every rank
    into the same path (its other writes go through the rank-0-only visualizer). Where ranks share
    the work dir (every multi-node job, a must here: :func:`check_shared_work_dir`) their writes
    of different lengths can interleave into invalid JSON. On the other ranks the hook logs the
    same line and writes nothing (the metrics are rank 0's: the evaluator broadcasts them).
    Call after the runner is built (its process group is up)."""
    from mmengine.dist import is_main_process
    from mmengine.hooks import LoggerHook

    def log_only(runner, metrics=None) -> None:  # LoggerHook.after_test_epoch without its dump
        _, log_str = runner.log_processor.get_log_after_epoch(runner, len(runner.test_dataloader), "test",
                                                              with_non_scalar=True)
        runner.logger.info(log_str)

    if not is_main_process():
        for hook in runner.hooks:
            if isinstance(hook, LoggerHook):
                hook.after_test_epoch = log_only  # the Runner calls hooks by attribute


def world_size_of_launch(launcher: str) -> int:
    """The number of processes of this launch, before any process group exists (torchrun's
    ``WORLD_SIZE``, SLURM's ``SLURM_NTASKS``, MPI's ``OMPI_COMM_WORLD_SIZE``; 1 without a launcher)."""
    names = {"pytorch": "WORLD_SIZE", "slurm": "SLURM_NTASKS", "mpi": "OMPI_COMM_WORLD_SIZE"}
    if launcher == "none":
        return 1
    return int(os.environ.get(names[launcher], os.environ.get("WORLD_SIZE", "1")))


def check_shard_folder(cfg: Config, folder: str) -> None:
    """tools/test.py's check of a sharded FSDP checkpoint folder: a FlexibleRunner config, and
    as many processes as ranks saved it (:func:`swin_backbone.mmlab.fsdp.check_shards`)."""
    from ..mmlab.fsdp import check_shards, shard_count

    if cfg.get("runner_type") != "FlexibleRunner" or "FSDP" not in str(cfg.get("strategy", {}).get("type", "")):
        raise ValueError(f"checkpoint {folder!r}: a folder (a sharded FSDP checkpoint of {shard_count(folder)} ranks), "
                         "which only an FSDP config (runner_type='FlexibleRunner', an FSDP strategy) reads; expected "
                         "a checkpoint file for this config")
    check_shards(folder, world_size_of_launch(cfg.get("launcher", "none")))


def single_process_runner(cfg: Config, checkpoint: str) -> None:
    """A FlexibleRunner config (e.g. FSDP) tested in one process (no launcher) from a checkpoint
    file: mmengine's Runner with the same model (FSDP needs a process group; one process has
    nothing to shard)."""
    if cfg.get("runner_type") == "FlexibleRunner" and cfg.get("launcher", "none") == "none" \
            and not osp.isdir(checkpoint):
        from mmengine.logging import print_log

        cfg.pop("runner_type")
        strategy = cfg.pop("strategy", None)
        kind = strategy and strategy.get("type")
        print_log(f"one process: testing with mmengine's Runner (the config's strategy {kind} needs a distributed "
                  "launch)", logger="current")


def require_checkpoint_match_any(runner, checkpoint: str) -> None:
    """:func:`require_checkpoint_match` for mmengine's ``Runner`` and ``FlexibleRunner``: the
    FlexibleRunner builds its model inside ``test()``; a strategy with ``min_checkpoint_match``
    (:class:`~swin_backbone.mmlab.fsdp.SwinFSDPStrategy`) checks its own loading, any other gets the
    hooks on the model as soon as it is built."""
    from types import SimpleNamespace

    from mmengine.runner import FlexibleRunner

    from ..mmlab.runner import MIN_MATCH

    if not isinstance(runner, FlexibleRunner):
        require_checkpoint_match(runner, checkpoint)
        return
    strategy = runner.strategy
    if hasattr(strategy, "min_checkpoint_match"):
        strategy.min_checkpoint_match = MIN_MATCH
        return
    build = strategy.build_model

    def build_and_check(model):
        model = build(model)
        require_checkpoint_match(SimpleNamespace(model=model), checkpoint)
        return model

    strategy.build_model = build_and_check


def read_metrics(work_dir: str) -> list:
    """Every metrics row mmengine logged under ``work_dir``, oldest run first.

    Training runs write ``<ts>/vis_data/scalars.json``; test runs ``<ts>/<ts>.json``.
    """
    import glob
    import json

    rows = []
    runs = sorted(glob.glob(osp.join(work_dir, "*", "")), key=osp.getmtime)
    for run in runs:
        ts = osp.basename(osp.normpath(run))
        for path in (osp.join(run, "vis_data", "scalars.json"), osp.join(run, f"{ts}.json")):
            if osp.isfile(path):
                with open(path) as f:
                    rows += [json.loads(line) for line in f if line.strip()]
    return rows

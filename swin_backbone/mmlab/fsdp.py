"""What the FSDP recipes need beyond mmengine 0.10.7's ``FSDPStrategy`` (configs/_base_/fsdp.py,
docs/large-models.md). Configs name these by dotted path, which mmengine's ``Registry.get`` imports
when the name is not registered, so a config (and the copy mmengine writes into the work dir) holds
values only and loads in any fresh process::

    strategy = dict(type='swin_backbone.mmlab.fsdp.SwinFSDPStrategy',
                    model_wrapper=dict(auto_wrap_policy='swin_backbone.mmlab.fsdp.swin_block_wrap_policy', ...))

* :func:`swin_block_wrap_policy`: one FSDP unit per ``SwinBlock`` / ``SwinBlockV2``;
* :class:`SwinFSDPStrategy`: ``FSDPStrategy`` with
  - gradient clipping by the norm of the whole model (``FullyShardedDataParallel.clip_grad_norm_``,
    every rank; after the loss scaler's unscale under ``AmpOptimWrapper``), the global norm logged;
  - checkpoints read by what they are, not by ``state_dict_cfg``: a *file* (a full state dict:
    what ``state_dict_cfg='full'`` saves, a DDP run's checkpoint, a model-zoo detector) loads into
    every rank at any world size, with the backbone's key conversion; a *folder* of ``rankN.pth``
    (``state_dict_cfg='local'``) loads at the world size that saved it, and another world size is
    a clear error;
  - resuming on torch >= 2.1 (mmengine calls ``FSDP.optim_state_dict_to_load`` with torch 2.0's
    argument order);
  - ``skip_init_weights=True`` that keeps what no checkpoint holds: parameters alone are built
    without values (:func:`parameters_on_meta`), buffers and every other tensor a constructor
    makes keep theirs (mmengine builds everything on the meta device, so a data preprocessor's
    mean and std, buffers outside the state dict, become uninitialised memory), and the model
    refuses to run until a checkpoint gave every parameter a value;
* :func:`sharded_classes`: FSDP's ``ShardedTensor`` classes, which ``state_dict_cfg='local'``
  shards hold, called for the strategy's own loads of shards only (scoped to that load, never
  process-wide: unpickling a ``ShardedTensor`` consults the process group).

A checkpoint file reads through :func:`~swin_backbone.checkpoint.read_checkpoint` (the package's
inert unpickler); a shard of a ``'local'`` folder through the same unpickler, with
:func:`sharded_classes` beside its table for that load.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import os.path as osp
import re
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from mmengine._strategy import FSDPStrategy
from mmengine.logging import print_log
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from ..model.blocks import SwinBlock
from ..model.v2 import SwinBlockV2

#: the prefix FSDP (wrapper API) puts before a unit's parameters in ``named_parameters()``
FSDP_PREFIX = "_fsdp_wrapped_module."
#: a shard file of a ``state_dict_cfg='local'`` checkpoint folder (mmengine's naming)
SHARD_NAME = re.compile(r"rank(\d+)\.pth")


def swin_block_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """FSDP auto-wrap policy: one unit per Swin block (V1 and V2); the rest is the root unit."""
    return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel,
                                        transformer_layer_cls={SwinBlock, SwinBlockV2})


def _process_group_state(owner: object, name: str, *default: object) -> object:
    """``builtins.getattr`` as a shard's pickle uses it: protocol 2 writes the nested class
    ``ShardedTensor.ProcessGroupState`` so; anything else is the table's getattr row (a
    HistoryBuffer statistic's name, or a refusal)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from ..checkpoint.records import method_name

    if owner is ShardedTensor and name == "ProcessGroupState" and not default:
        return ShardedTensor.ProcessGroupState
    return method_name(owner, name, *default)


def _rebuild_sharded_tensor(func: object, new_type: object, args: object, state: object) -> object:
    """``torch._tensor._rebuild_from_type_v2`` in a shard, which torch's calls with whatever the
    stack holds: here only torch's wrapper rebuild of a ``ShardedTensor``
    (:func:`_rebuild_sharded_wrapper`); any other call is the table's
    (:func:`~swin_backbone.checkpoint.records.rebuild_from_type_v2`: tensors and parameters)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata

    from ..checkpoint.records import brief, check_trusted_state, rebuild_from_type_v2, refuse

    if func is _rebuild_sharded_wrapper and new_type is ShardedTensor:
        check_trusted_state((args[1:] if type(args) is tuple else args, state), _sharded_types(), "a ShardedTensor")
        # ShardedTensor.__setstate__ takes (local shards, metadata, process group state, sharding spec,
        # init_rrefs); init_rrefs would register the tensor process-wide and call the RPC agent.
        if not (type(state) is tuple and len(state) == 5 and type(state[0]) is list
                and all(type(shard) is Shard for shard in state[0]) and type(state[1]) is ShardedTensorMetadata
                and type(state[2]) is ShardedTensor.ProcessGroupState and state[4] is False):
            raise refuse(f"a ShardedTensor's state: expected (shards, metadata, process group state, spec, False) as "
                         f"torch.save writes it with init_rrefs=False, found {brief(state)}")
        return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)
    return rebuild_from_type_v2(func, new_type, args, state)


def _rebuild_sharded_wrapper(cls: object, *args: object) -> object:
    """``torch._utils._rebuild_wrapper_subclass`` for a ``ShardedTensor`` only (it makes a
    tensor of any class it is handed)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from ..checkpoint.records import describe, refuse

    if cls is not ShardedTensor:
        raise refuse(f"_rebuild_wrapper_subclass in a shard: makes only a ShardedTensor, found {describe(cls)}")
    return torch._utils._rebuild_wrapper_subclass(cls, *args)


#: The layouts a shard's tensor properties name (``torch.serialization._get_layout``'s argument).
LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr",
           "torch.sparse_bsc", "torch._mkldnn", "torch.jagged")


def _get_layout(name: object) -> object:
    """``torch.serialization._get_layout`` for one of :data:`LAYOUTS` only."""
    from ..checkpoint.records import brief, refuse

    if type(name) is not str or name not in LAYOUTS:
        raise refuse(f"torch.serialization._get_layout({brief(name)}): expected one of {', '.join(LAYOUTS)}")
    return torch.serialization._get_layout(name)


def sharded_classes() -> Dict[str, object]:
    """What a ``state_dict_cfg='local'`` shard holds beyond the package's table: ``ShardedTensor``
    and its metadata classes, by the name its pickle uses, for the shard loads of
    :meth:`SwinFSDPStrategy.load_checkpoint` only (unpickling a ``ShardedTensor`` consults the
    process group, which no inert record can stand for). The rest of a shard (the message hub,
    optimizer, meta) reads through the table as any checkpoint does."""
    import torch.distributed._shard.metadata as shard_metadata
    import torch.distributed._shard.sharded_tensor as sharded
    import torch.distributed._shard.sharding_spec.chunk_sharding_spec as chunk_spec
    import torch.distributed.remote_device as remote_device

    objects = [sharded.ShardedTensor, sharded.ShardedTensor.ProcessGroupState, sharded.ShardedTensorMetadata, sharded.TensorProperties, sharded.Shard,
               sharded.metadata.MEM_FORMAT_ENCODING, shard_metadata.ShardMetadata, chunk_spec.ChunkShardingSpec,
               remote_device._remote_device]
    named = {f"{o.__module__}.{o.__qualname__}": o for o in objects}
    named.update({"torch.distributed._shard.sharded_tensor.api.ShardedTensor": sharded.ShardedTensor,
                  "builtins.getattr": _process_group_state,
                  "torch._utils._rebuild_wrapper_subclass": _rebuild_sharded_wrapper,
                  "torch._tensor._rebuild_from_type_v2": _rebuild_sharded_tensor,
                  "torch.serialization._get_layout": _get_layout})
    return named


@functools.lru_cache(maxsize=1)
def _sharded_types() -> Tuple[type, ...]:
    """The classes of :func:`sharded_classes` (once: a shard rebuilds many tensors)."""
    from ..checkpoint.records import trusted_types

    return trusted_types(sharded_classes())


def shard_count(folder: str) -> int:
    """Number of ranks that saved the sharded checkpoint ``folder`` (``rank0.pth`` ...).

    Raises:
        FileNotFoundError: no ``rankN.pth`` in ``folder``.
        ValueError: the ranks are not ``0 .. N-1`` (an incomplete copy).
    """
    ranks = sorted(int(m.group(1)) for m in map(SHARD_NAME.fullmatch, os.listdir(folder)) if m)
    if not ranks:
        raise FileNotFoundError(f"checkpoint {folder!r}: a folder without rankN.pth files; expected a checkpoint "
                                "file or a sharded FSDP checkpoint folder (state_dict_cfg='local')")
    if ranks != list(range(len(ranks))):
        raise ValueError(f"checkpoint {folder!r}: shards of ranks {ranks}; expected rank0.pth .. "
                         f"rank{ranks[-1]}.pth, all of them (an incomplete copy?)")
    return len(ranks)


def check_shards(folder: str, world_size: int) -> int:
    """:func:`shard_count`, required to equal ``world_size`` (a ``'local'`` shard holds this
    rank's slice of each unit's flat parameter, which only the same sharding can read)."""
    saved = shard_count(folder)
    if saved != world_size:
        raise ValueError(
            f"checkpoint {folder!r}: a sharded FSDP checkpoint of {saved} ranks (rank0.pth .. rank{saved - 1}.pth, "
            f"state_dict_cfg='local'), which loads only at the world size that saved it; this run has {world_size} "
            f"process(es). Launch {saved} in all (NNODES x NPROC = {saved}, e.g. tools/dist_test.sh CONFIG "
            f"CHECKPOINT {saved}), or train with state_dict_cfg='full' (the recipes' setting: one file that loads at "
            "any world size)")
    return saved


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (shapes, no values, no
    memory); their buffers and any other tensor they make stay where they are made, with their
    values. Constructors' initialisation of parameters then costs nothing (it runs on meta
    tensors). A parameter registered under two names stays one parameter."""
    register = nn.Module.register_parameter
    made: Dict[int, nn.Parameter] = {}  # id of a live original -> its meta parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is None or param.is_meta:
            return
        key = id(param)
        if key not in made:
            made[key] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            weakref.finalize(param, made.pop, key, None)  # (its id may be reused once it is gone)
        module._parameters[name] = made[key]

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialize_parameters(model: nn.Module, device: str = "cpu") -> None:
    """Give ``model``'s meta parameters uninitialised memory on ``device`` (as ``to_empty``, but
    tensors with values are left as they are). Before anything holds the parameters: they are
    new objects (an optimizer built earlier would hold the meta ones); one shared by two modules
    stays shared."""
    from ..checkpoint.loading import replace_meta_tensors

    replace_meta_tensors(model, lambda name, param: torch.empty_like(param, device=device), buffers=False)


class WeightsNotLoadedError(RuntimeError):
    """A model built with ``skip_init_weights=True`` ran before a checkpoint gave every one of
    its parameters a value."""


def _refuse_without_weights(module: nn.Module, args) -> None:
    raise WeightsNotLoadedError(
        "SwinFSDPStrategy(skip_init_weights=True) built the model's parameters without values "
        "(uninitialised memory) and no checkpoint has given them values yet: set load_from (a "
        "checkpoint of the whole model) or resume, or drop skip_init_weights")


def clean_name(name: str) -> str:
    """A parameter's name in the unwrapped model (``_fsdp_wrapped_module.`` removed)."""
    return name.replace(FSDP_PREFIX, "")


class SwinFSDPStrategy(FSDPStrategy):
    """mmengine's ``FSDPStrategy`` with global-norm clipping, checkpoints read by what they
    are (file or shard folder) and resuming on torch >= 2.1 (module docstring).

    ``min_checkpoint_match``: when set (tools/test.py sets it), loading a checkpoint that gives
    fewer than this fraction of the model's tensors a value is a
    :class:`~swin_backbone.mmlab.runner.CheckpointMismatchError`.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.min_checkpoint_match: Optional[float] = None
        self._loaded_shards = False  # the last load_checkpoint read a shard folder (its optimizer state is local)
        self._weightless = None  # skip_init_weights: the hook that refuses a forward until a load gave values

    # ------------------------------------------------------------------ building
    def build_model(self, model):
        """The model from its config. With ``skip_init_weights=True``, its parameters are built
        without values and get uninitialised memory on the CPU; everything else keeps the values
        its constructor gave it. A forward before :meth:`load_checkpoint` gave every parameter a
        value raises :class:`WeightsNotLoadedError`."""
        if not (self.skip_init_weights and isinstance(model, dict)):
            return super().build_model(model)
        from mmengine.registry import MODELS

        with parameters_on_meta():
            model = MODELS.build(model)  # (what mmengine's build does with a config)
        materialize_parameters(model, "cpu")
        model = super().build_model(model)  # (a built module: mmengine only does its bookkeeping)
        self._weightless = model.register_forward_pre_hook(_refuse_without_weights)
        return model

    # ------------------------------------------------------------------ clipping
    def build_optim_wrapper(self, optim_wrapper, model: Optional[nn.Module] = None):
        wrapper = super().build_optim_wrapper(optim_wrapper, model)
        root = model if model is not None else self.model
        from mmengine.optim import OptimWrapperDict

        for one in (wrapper.values() if isinstance(wrapper, OptimWrapperDict) else [wrapper]):
            global_norm_clipping(one, root)
        return wrapper

    # ------------------------------------------------------------------ checkpoints
    def _state_dict_context(self, shards: bool):
        """The model's and optimizer's state-dict type for a shard folder (local) or a file
        (full, on every rank: every rank holds the file, so the key conversion and the shapes it
        sees are the same on all ranks)."""
        from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig,
                                            LocalStateDictConfig)

        if shards:
            return FSDP.state_dict_type(self.model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(),
                                        LocalOptimStateDictConfig())
        return FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                    FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                    FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False))

    def load_checkpoint(self, filename: str, *, map_location="cpu", strict: bool = False,
                        revise_keys: Sequence[Tuple[str, str]] = ((r"^module\.", ""),),
                        callback: Optional[Callable] = None) -> dict:
        """Load ``filename`` into the wrapped model: a checkpoint file (or URL) as a full state
        dict on every rank, whatever ``state_dict_cfg`` this run saves with; a folder of
        ``rankN.pth`` as local shards, at the world size that saved them (:func:`check_shards`).

        Returns the checkpoint without its ``state_dict`` (optimizer, schedulers, meta)."""
        import torch.distributed as dist

        from ..checkpoint import read_checkpoint
        from ..checkpoint.mmengine_schemes import drop_executed_texts

        shards = osp.isdir(filename)
        path = filename
        if shards:
            check_shards(filename, dist.get_world_size())
            path = osp.join(filename, f"rank{dist.get_rank()}.pth")
        self.logger.info(f"Load checkpoint from {filename}" + (" (sharded: this rank's file)" if shards else
                                                               " (full state dict, on every rank)"))
        # a full file goes to the CPU whatever map_location says (every rank holds all of it); a
        # shard where mmengine would put it
        if not shards:
            map_location = "cpu"
        elif map_location == "default":
            from mmengine.device import get_device

            map_location = get_device()
        if shards:
            from ..checkpoint.files import read_torch_file, sniff

            checkpoint = read_torch_file(path, sniff(path), map_location=map_location, trusted=sharded_classes())
        else:
            checkpoint = read_checkpoint(path, map_location=map_location)
        drop_executed_texts(checkpoint, filename)  # (FlexibleRunner.resume executes meta['config'])
        if callback is not None:
            callback(checkpoint)
        if isinstance(checkpoint, dict) and "state_dict" in checkpoint:
            state_dict = checkpoint.pop("state_dict")
        else:  # a bare state dict
            state_dict, checkpoint = checkpoint, {}
        if not shards:
            for pattern, repl in revise_keys:
                state_dict = type(state_dict)((re.sub(pattern, repl, k), v) for k, v in state_dict.items())
        with self._state_dict_context(shards):
            incompatible = self.model.load_state_dict(state_dict, strict=strict)
        self._loaded_shards = shards
        if not shards:
            self._report_load(filename, incompatible)
        if self._weightless is not None:
            self._check_every_parameter(filename, incompatible.missing_keys, shards)
        return checkpoint

    def _check_every_parameter(self, filename: str, missing: Sequence[str], shards: bool) -> None:
        """After a load into a model built with ``skip_init_weights``: every parameter has a value
        now (the model may run), or the error names those left without one."""
        params = {clean_name(k) for k, _ in self.model.named_parameters()}
        # (a shard holds flat parameters only: whatever it misses is parameters)
        empty = sorted(clean_name(k) for k in missing if shards or clean_name(k) in params)
        if empty:
            raise WeightsNotLoadedError(
                f"skip_init_weights=True: {filename!r} gave no value to {len(empty)} parameter(s) of the model, "
                f"which hold uninitialised memory: {empty[:8]}{' ...' if len(empty) > 8 else ''}. Load a checkpoint "
                f"of the whole model, or drop skip_init_weights")
        self._weightless.remove()
        self._weightless = None

    def _report_load(self, filename: str, incompatible) -> None:
        from .runner import CheckpointMismatchError, match_report

        missing = [clean_name(k) for k in incompatible.missing_keys]
        unexpected = [clean_name(k) for k in incompatible.unexpected_keys]
        keys = [clean_name(k) for k, _ in self.model.named_parameters()]
        keys += [clean_name(k) for k, _ in self.model.named_buffers()]
        print_log(f"SwinFSDPStrategy: {filename!r} loaded {len(keys) - len(set(missing) & set(keys))} of the model's "
                  f"{len(keys)} tensors; missing: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                  f"({len(missing)}), unexpected: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                  f"({len(unexpected)})", logger="current", level=logging.INFO)
        if self.min_checkpoint_match is not None:
            message = match_report(keys, missing, unexpected, [], filename, self.min_checkpoint_match)
            if message:
                raise CheckpointMismatchError(message)

    def load_optim_state_dict(self, state_dict: dict) -> None:
        """Load the optimizer state of the checkpoint :meth:`load_checkpoint` read last (full or
        local), by keyword: torch >= 2.1 takes ``(model, optim, optim_state_dict)``."""
        optimizer = self.optim_wrapper.optimizer
        with self._state_dict_context(self._loaded_shards):
            to_load = FSDP.optim_state_dict_to_load(model=self.model, optim=optimizer, optim_state_dict=state_dict)
        self.optim_wrapper.load_state_dict(to_load)


# ---------------------------------------------------------------------------------------- clipping
def _clip_grad_global(wrapper) -> None:
    """``OptimWrapper._clip_grad`` under FSDP: the norm of all ranks' gradients of the whole
    model (FSDP's ``clip_grad_norm_``, a collective: every rank calls it), logged as
    ``train/grad_norm``."""
    norm = wrapper._fsdp_root.clip_grad_norm_(**wrapper.clip_grad_kwargs)
    wrapper.message_hub.update_scalar("train/grad_norm", float(norm))


def global_norm_clipping(wrapper, root: nn.Module) -> None:
    """Make ``wrapper`` (an mmengine ``OptimWrapper`` of the FSDP model ``root``) clip by the
    global gradient norm where ``clip_grad`` asks for norm clipping.

    mmengine's ``torch.nn.utils.clip_grad_norm_`` on a rank's parameters would clip each rank's
    shard by that shard's own norm. ``type='value'`` (element-wise) is right under sharding as it is."""
    if getattr(wrapper, "clip_func", None) is not torch.nn.utils.clip_grad_norm_:
        return
    if not isinstance(root, FSDP):
        raise TypeError(f"clip_grad under FSDP: expected the FullyShardedDataParallel root module, got "
                        f"{type(root).__name__}")
    extra = sorted(set(wrapper.clip_grad_kwargs) - {"max_norm", "norm_type"})
    if extra:
        raise ValueError(f"optim_wrapper.clip_grad under FSDP: FullyShardedDataParallel.clip_grad_norm_ takes "
                         f"max_norm and norm_type; got also {extra}")
    wrapper._fsdp_root = root
    wrapper._clip_grad = functools.partial(_clip_grad_global, wrapper)


__all__: List[str] = ["SwinFSDPStrategy", "swin_block_wrap_policy", "sharded_classes", "check_shards",
                      "shard_count", "global_norm_clipping", "parameters_on_meta", "materialize_parameters",
                      "WeightsNotLoadedError"]

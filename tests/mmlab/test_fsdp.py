"""Past one machine, tested on the CPU: the toy Mask R-CNN recipe on mmengine's FlexibleRunner with
FSDP (configs/toy/mask-rcnn_swin-toy_fpn_fsdp_toy-coco.py: swin_backbone.mmlab.fsdp.SwinFSDPStrategy,
one FSDP unit per Swin block, original parameters, with_cp, a frozen stage, per-stage learning
rates, gradient clipping, state_dict_cfg='full').

* the FSDP run, launched as 2 nodes of 1 process (tools/dist_train.sh with NNODES / NODE_RANK /
  MASTER_PORT), trains as the same recipe under DDPStrategy on 1 node of 2 processes: equal losses
  at every iteration (``LOSS_RTOL``), the same global gradient norm logged (clipping at work: the
  norm is above ``max_norm`` every iteration), the same validation metrics;
* its checkpoint is one file with the DDP run's weights, which swin_backbone.load_checkpoint,
  swin-convert-checkpoint and swin-extract-features read;
* the config mmengine dumped into its work dir, in fresh processes and unchanged: ``--resume`` from
  that file continues the run exactly, also with ``strategy.skip_init_weights=True`` (parameters
  built without values); tools/dist_test.sh (2 nodes, c10d) evaluates the file (``load_from``
  under FSDP) with the training validation's metrics;
* the FSDP wrapping the config asks for (mmengine's MMFullyShardedDataParallel, in 2 gloo
  processes): one unit per block, the optimizer's per-parameter settings as without FSDP, the
  frozen stage unchanged by training steps; SwinBackbone and SwinV2Backbone gradients under
  FSDP, and their clipping by the global norm, equal the unsharded model's; a model built
  without weights keeps its buffers' values and refuses to run until every parameter is loaded.

The segmentation recipe (bf16, sharded checkpoints, SLURM, load_from a model-zoo-format file) is in
tests/mmlab/test_fsdp_seg.py. Real torchrun processes, real gloo, real mmdet / mmengine, the generated
toy COCO."""
import glob
import os
import shutil

import numpy as np
import pytest
import torch
from mmengine.config import Config

from ..helpers import FAST, ROOT, assert_losses_close, free_port, launch, losses, scalars

FSDP_CFG = "configs/toy/mask-rcnn_swin-toy_fpn_fsdp_toy-coco.py"
DDP_CFG = "configs/toy/mask-rcnn_swin-toy_fpn_flexible-ddp_toy-coco.py"
ITERS = 3
#: FSDP reduce-scatters gradients where DDP all-reduces them, which may sum in another order
#: (other backends, more ranks): equal to float rounding. Seen here (gloo, 2 ranks): bit-identical.
LOSS_RTOL = 1e-5
#: a fixed seed (same initial weights and data order in every run), a constant learning rate
#: from the first iteration (the toy schedule's warm-up would leave the weights almost still),
#: every iteration logged, validation at the end. No random draws during training (mmengine does
#: not restore random states on resume): no flips, and the RPN / R-CNN heads take every anchor and
#: proposal (PseudoSampler) instead of a random sample, so a resumed run can equal the uninterrupted one.
RUN = FAST + ["randomness.seed=0", "param_scheduler.0.start_factor=1.0", "default_hooks.logger.interval=1",
              f"train_cfg.max_iters={ITERS}", f"train_cfg.val_interval={ITERS}", "default_hooks.checkpoint.interval=2",
              "train_dataloader.dataset.pipeline.3.prob=0.0", "model.train_cfg.rpn.sampler.type=PseudoSampler",
              "model.train_cfg.rcnn.sampler.type=PseudoSampler"]


def metrics(work):
    return [{k: v for k, v in row.items() if k.startswith("coco/")} for row in scalars(work) if "coco/bbox_mAP" in row]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, toy_data):  # noqa: F811
    """The reference: the recipe under DDPStrategy, 1 node of 2 processes."""
    work = str(tmp_path_factory.mktemp("ddp"))
    launch(["tools/dist_train.sh", DDP_CFG, "2", "--work-dir", work, "--cfg-options", *RUN], toy_data)
    return work


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, toy_data):  # noqa: F811
    """The recipe under FSDPStrategy, 2 nodes of 1 process (static rendezvous: NODE_RANK orders
    the ranks, so rank 0 logs the losses of the same half of each batch as the reference's)."""
    work = str(tmp_path_factory.mktemp("fsdp"))
    outs = launch(["tools/dist_train.sh", FSDP_CFG, "1", "--work-dir", work, "--cfg-options", *RUN], toy_data,
                  nnodes=2)
    return work, outs


def dumped_config(work):
    """The config mmengine wrote into the work dir (what users rerun, test and share)."""
    return os.path.join(work, os.path.basename(FSDP_CFG))


def assert_weights_close(got, expected, key, lr):
    """Trained weights agree to 1e-4, except where a gradient is near 0: there AdamW's normalised
    step is lr-sized with the sign of float noise (FSDP and DDP reduce in different orders), so a
    few weights (at most 1 in 10,000) may differ by up to two steps of lr per iteration."""
    diff = (got.float() - expected.float()).abs()
    off = diff > 1e-4 + 1e-4 * expected.float().abs()
    assert int(off.sum()) <= max(1, expected.numel() // 10000), (key, int(off.sum()), expected.numel())
    largest = float(diff.max()) if diff.numel() else 0.0
    assert largest <= 2 * lr * ITERS, (key, largest)


def test_fsdp_on_two_nodes_trains_as_ddp_on_one(ddp_run, fsdp_run):
    work, outs = fsdp_run
    log = open(glob.glob(os.path.join(work, "*", "*.log"))[0]).read()
    assert "Distributed training: True" in log and "GPU number: 2" in log  # mmengine's words for 2 ranks
    assert_losses_close(losses(work), losses(ddp_run), LOSS_RTOL)
    assert len(losses(work)) == ITERS
    # the losses moved: the comparison is not between two untrained models
    first, last = losses(ddp_run)[1]["loss"], losses(ddp_run)[ITERS]["loss"]
    assert abs(first - last) > 1e-3
    # clipping by the norm of the whole model's gradients (the toy clips at max_norm 10): the norm
    # logged is DDP's (rank 0's shard alone would give another), above max_norm: every step clipped
    norms, expected = losses(work, ("grad_norm",)), losses(ddp_run, ("grad_norm",))
    assert_losses_close(norms, expected, LOSS_RTOL)
    assert all(row["grad_norm"] > 10.0 for row in expected.values())
    got, expected = metrics(work), metrics(ddp_run)
    assert len(got) == len(expected) == 1
    assert got[0] == pytest.approx(expected[0], abs=1e-3)
    # state_dict_cfg='full': one file per save (rank 0 gathers), the DDP run's weights in the
    # unwrapped model's names (FlexibleRunner's DDP file names them module.*)
    assert os.path.isfile(os.path.join(work, "iter_2.pth")) and os.path.isfile(os.path.join(work, f"iter_{ITERS}.pth"))
    state = torch.load(os.path.join(work, f"iter_{ITERS}.pth"), map_location="cpu", weights_only=False)["state_dict"]
    ref = torch.load(os.path.join(ddp_run, f"iter_{ITERS}.pth"), map_location="cpu", weights_only=False)["state_dict"]
    ref = {k[len("module."):] if k.startswith("module.") else k: v for k, v in ref.items()}
    assert state.keys() == ref.keys()
    lr = Config.fromfile(os.path.join(ROOT, FSDP_CFG)).optim_wrapper.optimizer.lr  # (AdamW: steps of +-lr)
    for key, value in ref.items():
        assert_weights_close(state[key], value, key, lr)


def test_fsdp_checkpoint_file_reads_everywhere(tmp_path, fsdp_run, ddp_run):
    """The FSDP run's file, read as any checkpoint: swin_backbone.load_checkpoint (the backbone),
    swin-convert-checkpoint, swin-extract-features with the work-dir config (the same features
    as from the DDP run's file)."""
    from mmengine.config import Config

    from swin_backbone import SwinBackbone, load_checkpoint
    from swin_backbone.tools import convert_checkpoint, extract_features

    from ..helpers import features, write_images

    work, _ = fsdp_run
    ckpt = os.path.join(work, f"iter_{ITERS}.pth")
    backbone_cfg = Config.fromfile(dumped_config(work)).model.backbone.to_dict()
    backbone_cfg.pop("type"), backbone_cfg.pop("init_cfg", None), backbone_cfg.pop("_scope_", None)
    report = load_checkpoint(SwinBackbone(**backbone_cfg), ckpt)
    assert not report.missing and report.loaded
    assert convert_checkpoint.main([ckpt, str(tmp_path / "converted.pth"), "--to", "official"]) == 0
    converted = torch.load(tmp_path / "converted.pth", map_location="cpu", weights_only=True)
    converted = converted.get("state_dict", converted)
    assert any(k.startswith("layers.3.blocks.1.") for k in converted)  # the official layout
    images = tmp_path / "images"
    write_images(images)
    outs = {}
    for name, source in (("fsdp", ckpt), ("ddp", os.path.join(ddp_run, f"iter_{ITERS}.pth"))):
        outs[name] = tmp_path / name
        extract_features.extract([str(images / "nested"), str(outs[name]), "--config", dumped_config(work),
                                  "--checkpoint", source, "--no-progress", "--workers", "0"])
    got, expected = features(outs["fsdp"]), features(outs["ddp"])
    assert got.keys() == expected.keys() and got
    for image in expected:
        for stage, array in expected[image].items():
            assert np.allclose(got[image][stage], array, rtol=1e-3, atol=1e-3), (image, stage)


def test_work_dir_config_resumes_the_file_in_a_fresh_process(tmp_path, fsdp_run, toy_data):  # noqa: F811
    """The config mmengine dumped into the FSDP run's work dir, unchanged, in new processes (1 node
    of 2): ``--resume`` from the run's iteration-2 file continues it exactly. The file also holds
    an old run's ``meta['config']``, Python that ``FlexibleRunner.resume`` executes: the
    strategy's reader drops it, and it never runs."""
    from swin_backbone.checkpoint import read_checkpoint

    work, _ = fsdp_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    marker = tmp_path / "ran"
    checkpoint = read_checkpoint(os.path.join(work, "iter_2.pth"))
    checkpoint["meta"]["config"] = f"open({str(marker)!r}, 'w').close()\ngpu_ids = [0]\n"
    torch.save(checkpoint, resumed / "iter_2.pth")
    (resumed / "last_checkpoint").write_text(str(resumed / "iter_2.pth"))  # `--resume`: the latest one
    out = launch(["tools/dist_train.sh", dumped_config(work), "2", "--work-dir", str(resumed), "--resume"],
                 toy_data)[0]
    assert "resumed" in out.lower() and "meta['config'] dropped" in out and not marker.exists()
    continued = losses(str(resumed))
    assert sorted(continued) == list(range(3, ITERS + 1))
    assert_losses_close(continued, {it: v for it, v in losses(work).items() if it >= 3}, 1e-6)
    got, expected = metrics(str(resumed)), metrics(work)
    assert len(got) == len(expected) == 1 and got[0] == pytest.approx(expected[0], abs=1e-6)
    assert os.path.isfile(resumed / f"iter_{ITERS}.pth")


def test_resume_of_a_model_built_without_weights_continues_the_run(tmp_path, fsdp_run, toy_data):  # noqa: F811
    """``strategy.skip_init_weights=True`` (parameters built without values; buffers such as the
    data preprocessor's mean and std, which no checkpoint holds, keep theirs): ``--resume`` from
    the iteration-2 file continues the uninterrupted run exactly, as a model built normally does."""
    work, _ = fsdp_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(os.path.join(work, "iter_2.pth"), resumed / "iter_2.pth")
    (resumed / "last_checkpoint").write_text(str(resumed / "iter_2.pth"))
    launch(["tools/dist_train.sh", dumped_config(work), "2", "--work-dir", str(resumed), "--resume",
            "--cfg-options", "strategy.skip_init_weights=True"], toy_data)
    continued = losses(str(resumed))
    assert sorted(continued) == list(range(3, ITERS + 1))
    assert_losses_close(continued, {it: v for it, v in losses(work).items() if it >= 3}, 1e-6)


def test_dist_test_on_two_nodes_evaluates_the_fsdp_file(tmp_path, fsdp_run, toy_data):  # noqa: F811
    """tools/dist_test.sh as 2 nodes (c10d rendezvous) with the work-dir config (FlexibleRunner,
    FSDP: the file loads as ``load_from`` into the sharded model) gives the training's own
    validation metrics for the same weights."""
    work, _ = fsdp_run
    ckpt = os.path.join(work, f"iter_{ITERS}.pth")
    outs = launch(["tools/dist_test.sh", dumped_config(work), ckpt, "1", "--work-dir", str(tmp_path / "test")],
                  toy_data, nnodes=2, env=dict(RDZV_BACKEND="c10d"))
    assert "SwinFSDPStrategy" in "".join(outs)  # loaded by the FSDP strategy, not another runner
    got = metrics(str(tmp_path / "test"))
    assert len(got) == 1 and got[0] == pytest.approx(metrics(work)[0], abs=1e-6)


# --------------------------------------------------------------------- the wrapping, in-process ranks
def _spawn(fn, *args, world=2):
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(fn, args=(world, port) + args, nprocs=world, join=True)


def _init(rank, world, port):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _backbone_grads_rank(rank, world, port, cases):
    _init(rank, world, port)
    for version, with_cp in cases:
        _backbone_grads(rank, world, version, with_cp)


def _backbone_grads(rank, world, version, with_cp):
    """FSDP (one unit per block through the shipped wrap policy, original parameters) around a
    Swin with a frozen stage: after a backward of each rank's own images, the gathered gradients
    equal the unsharded model's on both ranks' images."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from swin_backbone import SwinBackbone, SwinBlock, SwinBlockV2, SwinV2Backbone
    from swin_backbone.mmlab.fsdp import swin_block_wrap_policy

    cls = SwinV2Backbone if version == 2 else SwinBackbone
    kw = dict(arch=None, embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), drop_path_rate=0.0,
              frozen_stages=1, with_cp=with_cp, window_size=4)
    torch.manual_seed(0)
    model = cls(**kw)
    model.init_weights()
    ref = cls(**kw)
    ref.load_state_dict(model.state_dict())
    sharded = FSDP(model, auto_wrap_policy=swin_block_wrap_policy, use_orig_params=True,
                   device_id=torch.device("cpu"))
    units = [m for m in FSDP.fsdp_modules(sharded) if isinstance(m.module, (SwinBlock, SwinBlockV2))]
    assert len(units) == 8  # one per block
    images = [torch.randn(2, 3, 40, 56, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    sum(o.square().mean() for o in sharded.train()(images[rank])).backward()
    sum(o.square().mean() for o in ref.train()(torch.cat(images))).backward()
    with FSDP.summon_full_params(sharded, with_grads=True):
        named = {k.replace("_fsdp_wrapped_module.", ""): v for k, v in sharded.named_parameters()}
        assert named.keys() == dict(ref.named_parameters()).keys()
        for name, p in ref.named_parameters():
            got = named[name]
            if not p.requires_grad:  # frozen stage 0 / patch embedding: no gradient (zeros where the
                # unit's flat gradient covers it: the patch embedding shares the root unit)
                assert got.grad is None or not got.grad.any(), name
            else:
                torch.testing.assert_close(got.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # clipping as SwinFSDPStrategy makes the optimizer wrapper clip: by the norm of all ranks'
    # gradients, logged; the same norm and clipped gradients as the unsharded model's
    from mmengine.optim import OptimWrapper

    from swin_backbone.mmlab.fsdp import global_norm_clipping

    max_norm = 1e-3
    wrapper = OptimWrapper(torch.optim.SGD([p for p in sharded.parameters() if p.requires_grad], lr=0.1),
                           clip_grad=dict(max_norm=max_norm))
    global_norm_clipping(wrapper, sharded)
    wrapper._clip_grad()
    norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], max_norm)
    assert norm > max_norm  # it clips
    assert wrapper.message_hub.get_scalar("train/grad_norm").current() == pytest.approx(float(norm), rel=1e-4)
    with FSDP.summon_full_params(sharded, with_grads=True):
        named = {k.replace("_fsdp_wrapped_module.", ""): v for k, v in sharded.named_parameters()}
        for name, p in ref.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(named[name].grad, p.grad, rtol=1e-4, atol=1e-9, msg=name)


def test_backbone_gradients_and_clipping_under_fsdp_equal_unsharded():
    _spawn(_backbone_grads_rank, [(1, True), (1, False), (2, False), (2, True)])


def _recipe_rank(rank, world, port, toy_data):  # noqa: F811
    """The config's own wrapping (mmengine MMFullyShardedDataParallel from ``strategy``): the
    optimizer's per-parameter settings equal those of the unwrapped model, and two training
    steps leave the frozen stage as it was and change the rest."""
    _init(rank, world, port)
    os.environ["TOY_DATA_ROOT"] = toy_data
    import swin_backbone  # first: where mmcv has no compiled ops, it gives mmcv its ops (mmcv-lite)
    from mmdet.testing import demo_mm_inputs
    from mmengine.config import Config
    from mmengine.optim import build_optim_wrapper
    from mmengine.registry import MODEL_WRAPPERS, DefaultScope
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from mmdet.registry import MODELS

    cfg = Config.fromfile(os.path.join(ROOT, FSDP_CFG))
    with DefaultScope.overwrite_default_scope("mmdet"):
        torch.manual_seed(0)
        model = MODELS.build(cfg.model)
        model.init_weights()
        start = {k: v.detach().clone() for k, v in model.named_parameters()}
        plain = MODELS.build(cfg.model)
        expected = {}
        for group in build_optim_wrapper(plain, cfg.optim_wrapper.copy()).optimizer.param_groups:
            names = {id(p): n for n, p in plain.named_parameters()}
            for p in group["params"]:
                expected[names[id(p)]] = (group["lr"], group["weight_decay"])
        wrapped = MODEL_WRAPPERS.build(cfg.strategy.model_wrapper, default_args=dict(
            module=model, device_id=int(os.environ["LOCAL_RANK"]), type="MMFullyShardedDataParallel"))
        blocks = [m for m in FSDP.fsdp_modules(wrapped) if isinstance(m.module, (swin_backbone.SwinBlock,))]
        assert len(blocks) == sum(model.backbone.depths)
        optim = build_optim_wrapper(wrapped, cfg.optim_wrapper.copy())
        names = {id(p): n.replace("_fsdp_wrapped_module.", "") for n, p in wrapped.module.named_parameters()}
        got = {names[id(p)]: (g["lr"], g["weight_decay"]) for g in optim.optimizer.param_groups for p in g["params"]}
        assert got == expected
        lr, decay = cfg.optim_wrapper.optimizer.lr, cfg.optim_wrapper.optimizer.weight_decay
        assert got["backbone.stages.1.blocks.0.attn.qkv.weight"] == pytest.approx((0.5 * lr, decay))
        assert got["backbone.stages.3.blocks.0.attn.qkv.weight"] == pytest.approx((lr, decay))
        assert got["backbone.stages.3.blocks.0.norm1.weight"] == pytest.approx((lr, 0.0))
        for step in range(2):
            data = demo_mm_inputs(batch_size=1, image_shapes=[(3, 96, 128)], num_items=[3], num_classes=3,
                                  with_mask=True)
            wrapped.train_step(data, optim)
        with FSDP.summon_full_params(wrapped):
            now = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in wrapped.named_parameters()}
        assert now.keys() == start.keys()
        frozen = [k for k in start if k.startswith(("backbone.patch_embed.", "backbone.stages.0.", "backbone.norm0."))]
        assert frozen and all(torch.equal(now[k], start[k]) for k in frozen)
        trained = [k for k in start if k.startswith("backbone.stages.1.blocks.") and k.endswith("weight")]
        assert trained and all(not torch.equal(now[k], start[k]) for k in trained)


def test_recipe_wrapping_keeps_paramwise_settings_and_frozen_stage(toy_data):  # noqa: F811
    _spawn(_recipe_rank, toy_data)


def _weightless_rank(rank, world, port, folder):
    _init(rank, world, port)
    import swin_backbone  # noqa: F401  (first: mmcv-lite's ops where mmcv has none)
    from mmdet.registry import MODELS
    from mmdet.testing import demo_mm_inputs
    from mmengine.registry import MODEL_WRAPPERS, DefaultScope

    from swin_backbone.mmlab.fsdp import SwinFSDPStrategy, WeightsNotLoadedError

    cfg = Config.fromfile(os.path.join(ROOT, FSDP_CFG))
    with DefaultScope.overwrite_default_scope("mmdet"):
        torch.manual_seed(0)
        ref = MODELS.build(cfg.model)
        ref.init_weights()
        strategy = SwinFSDPStrategy(skip_init_weights=True)
        model = strategy.build_model(cfg.model)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert sorted(strategy.id_to_name[id(p)] for p in model.parameters()) == sorted(
            n for n, _ in ref.named_parameters())
        buffers = dict(ref.named_buffers())
        assert "data_preprocessor.mean" in buffers
        for name, buffer in model.named_buffers():
            assert torch.equal(buffer, buffers[name]), name
        data = demo_mm_inputs(batch_size=1, image_shapes=[(3, 96, 128)], num_items=[3], num_classes=3,
                              with_mask=True)
        ref.eval(), model.eval()
        inputs = model.data_preprocessor(data, False)  # (the buffers' values at work)
        with torch.no_grad():
            expected = torch.utils._pytree.tree_leaves(ref(**ref.data_preprocessor(data, False), mode="tensor"))
        with pytest.raises(WeightsNotLoadedError, match="load_from"):
            model.val_step(data)
        strategy.model = MODEL_WRAPPERS.build(cfg.strategy.model_wrapper, default_args=dict(
            module=model, device_id=int(os.environ["LOCAL_RANK"]), type="MMFullyShardedDataParallel"))
        with pytest.raises(WeightsNotLoadedError, match=r"gave no value to \d+ parameter.*roi_head\.mask_head\."):
            strategy.load_checkpoint(os.path.join(folder, "partial.pth"))
        with pytest.raises(WeightsNotLoadedError):  # (the module inside FSDP: refused before FSDP's forward begins)
            strategy.model.module.val_step(data)
        strategy.load_checkpoint(os.path.join(folder, "whole.pth"))
        with torch.no_grad():
            got = torch.utils._pytree.tree_leaves(strategy.model(**inputs, mode="tensor"))
        assert len(got) == len(expected) and all(t.numel() for t in expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


def test_a_model_built_without_weights_runs_only_once_every_parameter_is_loaded(tmp_path):
    """``SwinFSDPStrategy(skip_init_weights=True)``, 2 gloo ranks: parameters on the CPU without
    values (mmengine's bookkeeping names each), buffers with their constructor's values (the data
    preprocessor's mean and std, outside the state dict); under FSDP, a forward before a load, or
    after a load that left parameters without values (named), is an error; after a whole
    checkpoint the sharded model predicts what the checkpoint's model predicts."""
    from mmdet.registry import MODELS
    from mmengine.registry import DefaultScope

    cfg = Config.fromfile(os.path.join(ROOT, FSDP_CFG))
    with DefaultScope.overwrite_default_scope("mmdet"):
        torch.manual_seed(0)
        ref = MODELS.build(cfg.model)
        ref.init_weights()
    state = ref.state_dict()
    torch.save({"state_dict": state}, tmp_path / "whole.pth")
    torch.save({k: v for k, v in state.items() if not k.startswith("roi_head.mask_head.")}, tmp_path / "partial.pth")
    _spawn(_weightless_rank, str(tmp_path))

"""The one-word switch with the config's own weights (issue #36): every Swin config shipped with
mmdet 3.3 and mmseg 1.2 that names its ImageNet weights (``init_cfg`` ``Pretrained`` /
``pretrained``, always a URL), built with ``type='SwinBackbone'`` and that same reference
pointed at a loopback HTTP server, ``init_weights()`` called, gives the features of the
library's own ``SwinTransformer`` initialised from the same URL (``mask_padding=False``, 1e-4).

The server holds, at each URL's path, a file in the layout that URL serves: the official
classifier file (``{'model': ...}``, head, final ``norm``, index and mask buffers) for the
``github.com/SwinTransformer`` releases, which mmdet's configs read with ``convert_weights=True``;
what mmseg's own ``swin2mmseg.py`` converter writes from it for
``download.openmmlab.com/mmsegmentation/v0.5/pretrain/swin``. The weights are random (with
non-trivial norms, biases and position tables) in the config's architecture. Each URL is
downloaded once: ours and the library read the same torch hub cache. The configs are found as
tests/mmlab/library_configs.py finds them (new releases' configs are covered without editing this).
"""
from __future__ import annotations

import copy
import importlib.util
import io
import os
import re
import warnings
from collections import OrderedDict
from urllib.parse import urlparse

import pytest
import torch
from mmengine.config import ConfigDict

pytest.importorskip("mmdet")
pytest.importorskip("mmseg")

from swin_backbone import SwinBackbone, load_checkpoint  # noqa: E402
from swin_backbone.checkpoint import prepare_state_dict  # noqa: E402
from swin_backbone.checkpoint.base import FROM_OURS  # noqa: E402
from swin_backbone.model.dropin import PRETRAINED_DEPRECATION  # noqa: E402

from ..mmlab.library_configs import (CASES, assert_case_features, build, config_root, one_word_change,  # noqa: E402
                                     perturb)
from .loopback import Loopback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_of(backbone: dict) -> str:
    init = backbone.get("init_cfg")
    if isinstance(init, dict) and init.get("type") == "Pretrained":
        return init["checkpoint"]
    return backbone.get("pretrained") or ""


#: checkpoint URL -> the cases (distinct backbone dicts) that name it.
GROUPS: "OrderedDict[str, list]" = OrderedDict()
for _case in CASES:
    if not _case.error and reference_of(_case.backbone):
        GROUPS.setdefault(reference_of(_case.backbone), []).append(_case)


def test_every_shipped_weight_reference_is_a_url_this_test_serves():
    assert len(GROUPS) >= 10 and sum(map(len, GROUPS.values())) >= 25, {k: len(v) for k, v in GROUPS.items()}
    for url in GROUPS:
        assert layout_of(url) in ("official", "mmseg"), url
    assert "https://github.com/SwinTransformer/storage/releases/download/v1.0.0/swin_tiny_patch4_window7_224.pth" \
        in GROUPS


def layout_of(url: str) -> str:
    host = urlparse(url).netloc
    if host == "github.com" and "/SwinTransformer/storage/" in url:
        return "official"
    if host == "download.openmmlab.com" and "/mmsegmentation/v0.5/pretrain/swin/" in url:
        return "mmseg"
    return "unknown"


def on_loopback(server: Loopback, url: str) -> str:
    parts = urlparse(url)
    return server.url(f"/{parts.netloc}{parts.path}")


def with_reference(backbone: dict, url: str) -> dict:
    """The backbone dict with its checkpoint reference replaced by ``url``, as the ``ConfigDict``
    a Runner builds from (mmdet's init_weights reads ``init_cfg.checkpoint``)."""
    cfg = dict(backbone)
    if isinstance(cfg.get("init_cfg"), dict) and cfg["init_cfg"].get("type") == "Pretrained":
        cfg["init_cfg"] = dict(cfg["init_cfg"], checkpoint=url)
    else:
        cfg["pretrained"] = url
    return ConfigDict(cfg)


def _mmseg_converter():
    """mmseg's own ``convert_swin`` (tools/model_converters/swin2mmseg.py, shipped in its .mim)."""
    path = os.path.join(os.path.dirname(config_root("mmseg")), "tools", "model_converters", "swin2mmseg.py")
    spec = importlib.util.spec_from_file_location("swin2mmseg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.convert_swin


def served_file(lib: str, backbone: dict, layout: str) -> bytes:
    """Random weights of ``backbone``'s architecture in ``layout``, as ``torch.save`` bytes."""
    cfg = dict(backbone, init_cfg=None, pretrained=None, drop_path_rate=0.0)
    if "convert_weights" in cfg:
        cfg["convert_weights"] = False
    ref = build(lib, cfg)
    perturb(ref)
    # the classifier's layout (official keys) through ours, plus what a classifier file holds
    ours = SwinBackbone(arch=None, embed_dims=backbone["embed_dims"], depths=backbone["depths"],
                        num_heads=backbone["num_heads"], window_size=backbone.get("window_size", 7),
                        out_indices=tuple(backbone.get("out_indices", range(len(backbone["depths"])))))
    load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    last = len(backbone["depths"]) - 1
    official = OrderedDict()
    for key, value in FROM_OURS["official"](ours.state_dict()).items():
        if re.fullmatch(r"norm\d+\.(weight|bias)", key):
            if key.startswith(f"norm{last}."):
                official["norm." + key.split(".")[1]] = value  # the classifier's final norm
            continue  # a classifier has no other output norms
        official[key] = value
    for key, value in ref.state_dict().items():  # buffers the official model saves
        if key.endswith("relative_position_index"):
            official[key.replace("stages.", "layers.", 1).replace(".w_msa.", ".")] = value
    official["head.weight"] = torch.randn(10, ours.num_features[-1])
    official["head.bias"] = torch.randn(10)
    buf = io.BytesIO()
    torch.save({"model": official} if layout == "official" else _mmseg_converter()(official), buf)
    return buf.getvalue()


def given_depths(report) -> list:
    """The stages a load report's loaded keys cover."""
    return sorted({int(m.group(1)) for m in map(re.compile(r"^stages\.(\d+)\.").match, report.loaded) if m})


@pytest.fixture(scope="module")
def server():
    srv = Loopback()
    yield srv
    srv.close()


@pytest.mark.parametrize("url", list(GROUPS), ids=[os.path.basename(u) for u in GROUPS])
def test_switched_config_with_its_own_weights_gives_the_librarys_features(url, server, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    cases = GROUPS[url]
    first = cases[0]
    layout = layout_of(url)
    local = on_loopback(server, url)
    path = urlparse(local).path
    server.serve(path, served_file(first.lib, first.backbone, layout))
    try:
        for case in cases:
            backbone = with_reference(case.backbone, local)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=PRETRAINED_DEPRECATION)
                ours = build(case.lib, dict(one_word_change(backbone), mask_padding=False))
                ours.init_weights()
                ref = build(case.lib, backbone)
                ref.init_weights()
            # Tensors the file does not hold start random in each class (a config may add a stage
            # the ImageNet file lacks, as rtmdet's p6: a 4-stage file, a 5-stage backbone): they
            # are taken from the library's model, so the comparison is of what was loaded.
            given = load_checkpoint(copy.deepcopy(ours), local, final_norm=False, logger=None)  # (the cache)
            absent = [k for k in given.missing if not re.fullmatch(r"norm\d+\.(weight|bias)", k)]
            n = len(given_depths(given))  # (beyond the file: later stages and the merging into them)
            assert all(k.startswith((f"stages.{n}.", f"stages.{n - 1}.downsample.")) for k in absent), absent
            if given.missing:
                theirs, _ = prepare_state_dict(ref.state_dict(), ours)
                ours.load_state_dict({k: theirs[k] for k in given.missing}, strict=False)
            ours.eval()
            ref.eval()  # (mmdet's train() returns None: no chaining)
            assert_case_features(case, ours, ref)
            # the weights did arrive: stage 1's first qkv is the served file's, not an initialisation
            assert not torch.allclose(ours.stages[0].blocks[0].attn.qkv.bias, torch.zeros(1))
            del ours, ref
        assert server.requests[path] == 1, dict(server.requests)  # one download; every other read: the cache
    finally:
        server.files.pop(path, None)

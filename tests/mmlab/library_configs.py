"""The Swin backbone dicts of mmdet's and mmseg's own shipped configs (every config that names
``SwinTransformer`` or inherits from one, de-duplicated), and what the tests that compare
``SwinBackbone`` with them share: building under the library's scope, perturbed weights, the
features compared (tests/mmlab/test_dropin.py, tests/checkpoint/test_stock_config_weights.py)."""
from __future__ import annotations

import copy
import glob
import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from mmengine.config import Config
from mmengine.registry import DefaultScope
from torch import nn

LIBS = ("mmdet", "mmseg")
#: Odd in both directions and not a multiple of 4 * window: every stage pads its windows.
ODD_SIZE = (61, 83)
REFERENCE = "SwinTransformer"


# ---------------------------------------------------------------- finding the configs
def config_root(lib: str) -> str:
    """The configs shipped inside an installed OpenMMLab package (``<pkg>/.mim/configs``)."""
    spec = importlib.util.find_spec(lib)
    assert spec is not None and spec.submodule_search_locations, f"{lib} is not installed"
    return os.path.join(spec.submodule_search_locations[0], ".mim", "configs")


def candidate_configs(roots: Dict[str, str]) -> List[Tuple[str, str]]:
    """``(lib, path)`` of every config that names ``SwinTransformer`` or inherits from one.

    A text pre-filter (loading all ~1600 configs would take minutes): the files that say
    ``SwinTransformer``, then, until nothing changes, the files whose ``_base_`` names one of
    them. Whether a candidate really builds a Swin backbone is decided on the loaded config.
    """
    texts = {}
    for lib, root in roots.items():
        for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8") as f:
                texts[(lib, path)] = f.read()
    found = {key for key, text in texts.items() if REFERENCE in text}
    while True:
        names = {os.path.basename(path) for _, path in found}
        more = {
            key
            for key, text in texts.items()
            if key not in found and "_base_" in text and any(name in text for name in names)
        }
        if not more:
            return sorted(found)
        found |= more


def swin_backbones(obj: Any, parent: Optional[dict] = None) -> Iterator[Tuple[dict, Optional[dict]]]:
    """Every ``dict(type='SwinTransformer' | '<scope>.SwinTransformer', ...)`` in a config,
    with the dict that holds it (the model, whose ``pretrained`` mmseg hands down)."""
    if isinstance(obj, dict):
        kind = obj.get("type")
        if isinstance(kind, str) and kind.rsplit(".", 1)[-1] == REFERENCE:
            yield obj, parent
        for value in obj.values():
            yield from swin_backbones(value, obj)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from swin_backbones(value, parent)


def canonical(obj: Any) -> Any:
    """A hashable, order-independent form of a config value (for de-duplication)."""
    if isinstance(obj, dict):
        return tuple(sorted((k, canonical(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(canonical(v) for v in obj))
    return obj


@dataclass
class Case:
    """One distinct Swin backbone dict and the configs it was found in."""

    lib: str
    paths: List[str]
    backbone: Dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def id(self) -> str:
        return f"{self.lib}/{self.paths[0]}"


def discover() -> Tuple[List[Case], List[str]]:
    """The distinct backbone dicts (first config path as the id) and all config paths found."""
    roots = {lib: config_root(lib) for lib in LIBS}
    cases: Dict[Any, Case] = {}
    all_paths = []
    for lib, path in candidate_configs(roots):
        rel = os.path.relpath(path, roots[lib])
        try:  # custom_imports name projects that need not be installed; the model is plain data
            cfg = Config.fromfile(path, import_custom_modules=False).to_dict()
        except Exception as err:  # a config we cannot even read must fail, not vanish
            cases[(lib, rel)] = Case(lib, [rel], error=f"{type(err).__name__}: {err}")
            continue
        for backbone, parent in swin_backbones(cfg):
            backbone = copy.deepcopy(backbone)
            if parent is not None and parent.get("pretrained") is not None:  # mmseg segmentors
                backbone["pretrained"] = parent["pretrained"]
            all_paths.append(f"{lib}/{rel}")
            key = (lib, canonical(backbone))
            if key in cases:
                cases[key].paths.append(rel)
            else:
                cases[key] = Case(lib, [rel], backbone)
    return list(cases.values()), sorted(set(all_paths))


CASES, CONFIG_PATHS = discover()


def one_word_change(backbone: Dict[str, Any]) -> Dict[str, Any]:
    """``type='[scope.]SwinTransformer'`` -> ``type='[scope.]SwinBackbone'``, nothing else."""
    cfg = copy.deepcopy(backbone)
    cfg["type"] = cfg["type"].replace(REFERENCE, "SwinBackbone")
    return cfg


def build(lib: str, cfg: Dict[str, Any]) -> nn.Module:
    """Build from the library's ``MODELS`` under its default scope, as its Runner would."""
    registry = importlib.import_module(f"{lib}.registry").MODELS
    with DefaultScope.overwrite_default_scope(lib):
        return registry.build(copy.deepcopy(cfg))


def perturb(model: nn.Module) -> None:
    """Random norm scales, biases and relative position tables (freshly built they are 1, 0
    and 0, which would hide a wrongly mapped or reordered tensor)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif p.dim() == 1 or name.endswith("relative_position_bias_table"):
                p.normal_(0.0, 0.1)


def assert_same_features(ours: nn.Module, ref: nn.Module, size: Tuple[int, int] = ODD_SIZE) -> None:
    """Both backbones' feature maps of one random ``size`` image agree (1e-4)."""
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        for g, e in zip(ours(x), ref(x)):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def assert_case_features(case: Case, ours: nn.Module, ref: nn.Module) -> None:
    """Both backbones' feature maps of one random ``ODD_SIZE`` image agree (1e-4), one per
    ``out_indices`` entry of the config's backbone."""
    x = torch.randn(1, case.backbone.get("in_channels", 3), *ODD_SIZE)
    with torch.no_grad():
        expected = ref(x)
        got = ours(x)
    assert len(got) == len(expected) == len(case.backbone.get("out_indices", (0, 1, 2, 3)))
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"{case.id} output {i}: {m}")

"""``import swin_backbone`` is light, and registration still reaches every registry in every order.

The import loads none of mmengine's models and optimizers (which import transformers and peft),
none of mmdet's or mmseg's models and no mmcv op (:mod:`swin_backbone.mmlab`); the classes load on
first use. Each case runs in a fresh interpreter: what one import order leaves in ``sys.modules``
must not leak into the next. (Import times are a benchmark's business, not a test's.)
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from .helpers import ROOT

# Every case is a fresh interpreter (a subprocess): out of `make test-fast`.
pytestmark = pytest.mark.slow

#: What the import must not load.
HEAVY = ("mmengine.model", "mmengine.optim", "mmengine.runner", "mmdet.models", "mmseg.models", "mmpretrain.models",
         "mmcv.ops", "mmcv._ext", "transformers", "peft", "swin_backbone.model.backbone", "swin_backbone.checkpoint")
LOG_LINE = "has no compiled ops (mmcv-lite)"


def run(code: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def result(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("JSON "))[5:])


def test_import_loads_nothing_heavy():
    out = run(f"""
        import json, sys
        import swin_backbone
        heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))
        names = sorted(swin_backbone.__all__)
        print('JSON ' + json.dumps(dict(heavy=heavy, all=names, missing=[n for n in names if n not in dir(swin_backbone)])))
        # every public name resolves (the heavy modules load now), to the object of its own module
        from swin_backbone.model.backbone import SwinBackbone
        from swin_backbone.mmlab.optim import BF16AutocastOptimWrapper
        assert swin_backbone.SwinBackbone is SwinBackbone
        assert swin_backbone.BF16AutocastOptimWrapper is BF16AutocastOptimWrapper
        for name in swin_backbone.__all__:
            getattr(swin_backbone, name)
        assert swin_backbone.ops is sys.modules['swin_backbone.ops']  # subpackages, as before
        try:
            swin_backbone.NoSuchName
        except AttributeError as e:
            print('ERROR', e)
    """)
    got = result(out)
    assert got["heavy"] == []
    assert got["missing"] == [] and {"SwinBackbone", "REGISTERED_IN", "PREPROCESSORS"} <= set(got["all"])
    assert "ERROR module 'swin_backbone' has no attribute 'NoSuchName'" in out
    assert LOG_LINE not in out  # the mmcv-lite line comes with the first op, not with an import


#: Import orders: swin_backbone first; the libraries' registries first; the libraries' models
#: imported and their registries already looked up; swin_backbone only through a config's
#: custom_imports after all that.
ORDERS = ["ours-first", "registries-first", "models-first", "custom-imports"]

ORDER_PROBE = """
import json, os, sys, tempfile
order = sys.argv[1]
if order == 'ours-first':
    import swin_backbone
import mmdet.registry, mmseg.registry
if order in ('models-first', 'custom-imports'):
    import mmengine.runner, mmdet.models, mmseg.models
    assert mmdet.registry.MODELS.get('ResNet') is not None and mmseg.registry.MODELS.get('ResNet') is not None
if order == 'custom-imports':
    from mmengine.config import Config
    path = os.path.join(tempfile.mkdtemp(), 'cfg.py')
    with open(path, 'w') as f:
        f.write("custom_imports = dict(imports=['swin_backbone'], allow_failed_imports=False)\\n"
                "backbone = dict(type='SwinBackbone', arch=None, embed_dims=16, depths=(1, 1), num_heads=(1, 2), out_indices=(1,))\\n")
    cfg = Config.fromfile(path)
    assert 'swin_backbone' in sys.modules
else:
    import swin_backbone
    cfg = dict(backbone=dict(type='SwinBackbone', arch=None, embed_dims=16, depths=(1, 1), num_heads=(1, 2), out_indices=(1,)))
import swin_backbone
from mmengine.registry import DefaultScope, init_default_scope
from mmengine.registry import MODELS as ROOT_MODELS, OPTIM_WRAPPERS
from mmdet.registry import MODELS as DET, OPTIM_WRAPPERS as DET_OPTIM
from mmseg.registry import MODELS as SEG
ours = swin_backbone.SwinBackbone
got = {}
got['det'] = type(DET.build(cfg['backbone'])) is ours
got['seg'] = type(SEG.build(cfg['backbone'])) is ours
got['get'] = [DET.get(n) is ours for n in ('SwinBackbone', 'mmdet.SwinBackbone', 'mmseg.SwinBackbone')]
got['v2'] = DET.get('SwinV2Backbone') is SEG.get('SwinV2Backbone') is swin_backbone.SwinV2Backbone
with DET.switch_scope_and_registry('mmdet') as registry:
    got['switched'] = registry.get('SwinBackbone') is ours
from swin_backbone.registry import MODELS as SCOPE
got['scope'] = SCOPE.get('SwinBackbone') is ours and SCOPE.get('SwinV2Backbone') is swin_backbone.SwinV2Backbone
from swin_backbone.mmlab.preprocessors import SwinDetDataPreprocessor, SwinSegDataPreProcessor
got['preprocessors'] = [type(DET.build(dict(type='SwinDetDataPreprocessor'))) is SwinDetDataPreprocessor,
                        type(SEG.build(dict(type='SwinSegDataPreProcessor'))) is SwinSegDataPreProcessor]
wrapper = swin_backbone.BF16AutocastOptimWrapper
got['optim'] = [OPTIM_WRAPPERS.get('BF16AutocastOptimWrapper') is wrapper,
                DET_OPTIM.get('BF16AutocastOptimWrapper') is wrapper]
from mmengine.config.utils import MODULE2PACKAGE
got['config_scope'] = MODULE2PACKAGE.get('swin_backbone')
from mmengine.runner.checkpoint import CheckpointLoader
from swin_backbone.checkpoint.mmengine_schemes import load_from_swin_backbone
got['checkpoint_loader'] = CheckpointLoader._get_checkpoint_loader('weights.pth') is load_from_swin_backbone
got['registered_in'] = swin_backbone.REGISTERED_IN
got['preprocessor_names'] = swin_backbone.PREPROCESSORS
init_default_scope('mmseg')  # (last: the default scope decides which registry every build below uses)
got['default_scope'] = type(ROOT_MODELS.build(cfg['backbone'])) is ours
print('JSON ' + json.dumps(got))
"""


@pytest.mark.parametrize("order", ORDERS)
def test_registration_in_every_import_order(order):
    got = result(run(ORDER_PROBE, order))
    assert got == dict(det=True, seg=True, get=[True, True, True], v2=True, default_scope=True, switched=True,
                       scope=True, preprocessors=[True, True], optim=[True, True], config_scope="swin_backbone.registry",
                       checkpoint_loader=True, registered_in=["mmdet", "mmseg"],
                       preprocessor_names=["SwinDetDataPreprocessor", "SwinSegDataPreProcessor"])


def test_a_submodule_import_plugs_the_checkpoint_converter_in():
    """``from swin_backbone.model.backbone import SwinBackbone`` gets what ``import swin_backbone``
    used to give it up front: the checkpoint key converter and the 'Pretrained' initializer."""
    out = run("""
        import json
        from swin_backbone.model.backbone import LOAD_STATE_DICT_PRE_HOOKS, PRETRAINED_INIT, SwinBackbone
        from mmengine.registry import WEIGHT_INITIALIZERS
        print('JSON ' + json.dumps(dict(hooks=len(LOAD_STATE_DICT_PRE_HOOKS),
                                        init=WEIGHT_INITIALIZERS.get(PRETRAINED_INIT) is not None)))
    """)
    assert result(out) == dict(hooks=1, init=True)


#: What ``swin-convert-checkpoint --help`` must not load: the model and the libraries (it needs
#: the checkpoint formats alone).
CONVERTER_HEAVY = ("swin_backbone.model", "mmdet", "mmseg", "mmpretrain", "mmengine.runner", "mmengine.model",
                   "transformers")


def test_converter_help_loads_neither_the_model_nor_the_libraries():
    out = run(f"""
        import json, runpy, sys
        sys.argv = ['swin-convert-checkpoint', '--help']
        try:
            runpy.run_module('swin_backbone.tools.convert_checkpoint', run_name='__main__')
        except SystemExit as e:
            assert e.code == 0, e.code
        heavy = sorted(m for m in sys.modules if m.startswith({CONVERTER_HEAVY!r}))
        print('JSON ' + json.dumps(dict(heavy=heavy)))
    """)
    assert "usage: swin-convert-checkpoint" in out and "--to {" in out
    assert result(out) == dict(heavy=[])


#: The public names of ``swin_backbone.checkpoint`` (its ``__all__``).
CHECKPOINT_NAMES = ("FORMATS", "CheckpointError", "CheckpointNotFoundError", "LoadReport", "detect_format",
                    "load_checkpoint", "prepare_state_dict", "read_checkpoint", "to_ours", "unwrap_state_dict",
                    "write_checkpoint")


def test_the_checkpoint_package_is_lazy_and_still_plugs_in():
    """``import swin_backbone.checkpoint`` loads none of its modules; each public name resolves
    to its module's object, and importing mmengine's runner and the model afterwards still plugs
    in the checkpoint reader, the key converter and the 'Pretrained' initializer."""
    out = run("""
        import json, sys
        import swin_backbone.checkpoint as ckpt
        loaded = sorted(m for m in sys.modules if m.startswith(('swin_backbone.checkpoint.', 'mmengine')))
        from swin_backbone.checkpoint.loading import read_checkpoint
        from swin_backbone.checkpoint import records
        names = {n: getattr(ckpt, n) is not None for n in ckpt.__all__}
        from mmengine.runner.checkpoint import CheckpointLoader
        from mmengine.registry import WEIGHT_INITIALIZERS
        from swin_backbone.checkpoint.mmengine_schemes import load_from_swin_backbone
        from swin_backbone.model.backbone import LOAD_STATE_DICT_PRE_HOOKS, PRETRAINED_INIT
        print('JSON ' + json.dumps(dict(
            loaded=loaded, names=names, same=ckpt.read_checkpoint is read_checkpoint,
            submodule=records is sys.modules['swin_backbone.checkpoint.records'],
            loader=CheckpointLoader._get_checkpoint_loader('weights.pth') is load_from_swin_backbone,
            hooks=len(LOAD_STATE_DICT_PRE_HOOKS), init=WEIGHT_INITIALIZERS.get(PRETRAINED_INIT) is not None)))
        try:
            ckpt.NoSuchName
        except AttributeError as e:
            print('ERROR', e)
    """)
    got = result(out)
    assert got.pop("names") == {n: True for n in CHECKPOINT_NAMES}
    assert got == dict(loaded=[], same=True, submodule=True, loader=True, hooks=1, init=True)
    assert "ERROR module 'swin_backbone.checkpoint' has no attribute 'NoSuchName'" in out


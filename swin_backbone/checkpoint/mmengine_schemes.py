"""mmengine's checkpoint loads through this package's reader.

mmengine's ``CheckpointLoader`` picks a loader by the path's prefix: its extension point.
:func:`register` (run by ``import swin_backbone``) puts :func:`load_from_swin_backbone` there for
local paths, ``http(s)://`` URLs and mmengine's named references (``torchvision://``,
``open-mmlab://``, ``mmcls://``). So ``load_from``, ``--resume`` (``Runner.resume``),
``mmengine.runner.load_checkpoint``, ``init_cfg=dict(type='Pretrained')`` of any module, mmdet's
``init_detector`` / mmseg's ``init_model`` and the inferencers' weights all read through the
inert unpickler (:mod:`.unpickler`), on every torch, and mmengine's own Runner checkpoints load on
torch >= 2.6 without widening torch's weights-only list. ``pavi://``, ``s3://`` / ``petrel://`` and
any scheme a user registers stay mmengine's (docs/checkpoints.md, "Security model").

mmengine executes three texts a checkpoint may hold as Python (``Config.fromstring``):
``meta['config']`` (mmcv 1.x and early mmengine runs; ``Runner.resume`` and
``FlexibleRunner.resume`` run it) is dropped; ``meta['cfg']`` and
``message_hub['runtime_info']['cfg']`` (what mmengine's Runner writes; the inferencers given
weights without a model config run it) are kept only where they are a plain config
(:func:`unplain_config`: assignments of literals and ``dict(...)``, the ``custom_imports`` of
OpenMMLab packages), so that running them builds dicts and nothing else. A warning names what is dropped.
"""
from __future__ import annotations

import ast
import os
import warnings
from typing import Any, List, Optional

#: The prefixes this package reads for mmengine ('' is mmengine's catch-all: local paths).
PREFIXES = ("", "http://", "https://", "torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")
#: The packages a kept config text's ``custom_imports`` may name (mmengine imports them when it reads the text).
CONFIG_IMPORTS = frozenset(("swin_backbone", "mmengine", "mmcv", "mmdet", "mmseg", "mmpretrain", "mmcls", "mmdet3d",
                            "mmpose", "mmyolo", "mmocr", "mmaction", "mmrotate", "mmtrack", "mmagic", "mmedit"))
#: A config text's size limit (a real config's pretty text is tens of KB).
MAX_CONFIG_TEXT = 4 * 2**20


def load_from_swin_backbone(filename: str, map_location: Any = None) -> Any:
    """mmengine's loader signature (``CheckpointLoader`` prints ``Loads checkpoint by
    swin_backbone backend``): what the file or reference holds, read as data only, without
    the Python texts mmengine would execute (:func:`drop_executed_texts`)."""
    from .loading import read_checkpoint

    path = filename if "://" in filename else os.path.expanduser(filename)
    checkpoint = read_checkpoint(path, map_location)
    drop_executed_texts(checkpoint, filename)
    return checkpoint


def drop_executed_texts(checkpoint: Any, source: str) -> None:
    """Remove from ``checkpoint`` (in place) ``meta['config']``, and ``meta['cfg']`` /
    ``message_hub['runtime_info']['cfg']`` where they are not a plain config
    (:func:`unplain_config`), warning with each name and why."""
    if not isinstance(checkpoint, dict):
        return
    meta, hub = checkpoint.get("meta"), checkpoint.get("message_hub")
    info = hub.get("runtime_info") if isinstance(hub, dict) else None
    for name, table, key in (("meta['config']", meta, "config"), ("meta['cfg']", meta, "cfg"),
                             ("message_hub['runtime_info']['cfg']", info, "cfg")):
        if not isinstance(table, dict) or key not in table:
            continue
        why = ("saved by mmcv 1.x or an early mmengine run, which mmengine's resume would execute" if key == "config"
               else unplain_config(table[key]))
        if why is not None:
            del table[key]
            warnings.warn(f"checkpoint {source}: {name} dropped: a Python config text that mmengine would execute, "
                          f"{why}; the rest of the checkpoint loads as saved (an inferencer then needs the model "
                          "config: DetInferencer(model='config.py', weights=...))", UserWarning, stacklevel=3)


def unplain_config(text: object) -> Optional[str]:
    """``None`` where ``text`` is a plain config, whose execution builds dicts and nothing else:
    statements ``name = value`` only, values of literals (numbers, strings, ``True`` / ``False`` /
    ``None``, lists, tuples, sets, ``{...}``) and ``dict(...)`` of them (mmengine's
    ``Config.pretty_text`` writes configs so), ``custom_imports`` naming only
    :data:`CONFIG_IMPORTS`; else why not (the first construct outside that)."""
    if not isinstance(text, str):
        return f"not a str but {type(text).__name__}"
    if len(text) > MAX_CONFIG_TEXT:
        return f"{len(text)} characters (at most {MAX_CONFIG_TEXT} are read)"
    if "{{" in text:  # (mmengine substitutes {{ ... }} in the text before it parses it)
        return "it holds '{{', a substitution mmengine makes before it runs the text"
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return f"it is not Python ({type(err).__name__})"
    for statement in tree.body:
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id not in ("dict", "_base_")):
            return f"line {statement.lineno} is not 'name = value' but {_source(text, statement)!r}"
        if statement.targets[0].id == "custom_imports":
            why = _unlisted_imports(statement.value)
            if why:
                return why
    stack: List[ast.AST] = [statement.value for statement in tree.body]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Constant) and node.value is not Ellipsis:
            continue
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            stack.extend(node.elts)
        elif isinstance(node, ast.Dict) and None not in node.keys:  # (None: a ** unpacking)
            stack.extend(node.keys)
            stack.extend(node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(
                node.operand, ast.Constant):
            continue
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
              and (not node.args or (len(node.args) == 1 and isinstance(node.args[0], ast.Dict)))
              and all(keyword.arg is not None for keyword in node.keywords)):
            stack.extend(node.args)
            stack.extend(keyword.value for keyword in node.keywords)
        else:
            return f"line {node.lineno} holds {_source(text, node)!r}, not a literal or dict(...)"
    return None


def _source(text: str, node: ast.AST) -> str:
    """The first 80 characters of ``node``'s text in ``text`` (Python 3.8: no ``ast.unparse``)."""
    return (ast.get_source_segment(text, node) or type(node).__name__)[:80]


def _unlisted_imports(value: ast.AST) -> Optional[str]:
    """Why a ``custom_imports`` value names a module outside :data:`CONFIG_IMPORTS` (``None``: it does not)."""
    fields: dict = {}
    if isinstance(value, ast.Call):  # dict(imports=..., allow_failed_imports=...)
        fields = {keyword.arg: keyword.value for keyword in value.keywords}
    elif isinstance(value, ast.Dict):
        fields = {k.value: v for k, v in zip(value.keys, value.values) if isinstance(k, ast.Constant)}
    try:
        imports = ast.literal_eval(fields["imports"])
    except (KeyError, ValueError, TypeError, SyntaxError, RecursionError):
        imports = None
    names = [imports] if isinstance(imports, str) else imports
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return "its custom_imports is not a dict(imports=...) of module names"
    others = [n for n in names if n.split(".")[0] not in CONFIG_IMPORTS]
    return f"its custom_imports names {others} (mmengine would import them)" if others else None


def register() -> None:
    """Make :func:`load_from_swin_backbone` mmengine's loader for :data:`PREFIXES`."""
    from mmengine.runner.checkpoint import CheckpointLoader

    CheckpointLoader.register_scheme(prefixes=list(PREFIXES), loader=load_from_swin_backbone, force=True)

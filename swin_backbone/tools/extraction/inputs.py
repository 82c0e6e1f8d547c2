"""Which images a run reads (a file, a folder searched recursively, or a glob) and the output
name of each, relative to OUT_DIR."""
from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional, Sequence, Tuple

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm")


def inside(path: str, folder: Optional[str]) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (resolved: links, ``..``, case as stored)."""
    if not folder:
        return False
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def find_images(spec: str, exclude: Optional[str] = None) -> Tuple[List[str], str]:
    """Image paths (sorted) for a file, folder or glob, and the root their output paths are
    relative to. Nothing under ``exclude`` (the output folder) counts as an input: a second
    run into ``IN/feats`` must not read its own ``--png`` visualisations as images."""
    if os.path.isdir(spec):
        paths = []
        for folder, subdirs, files in os.walk(spec):
            subdirs[:] = sorted(d for d in subdirs if not inside(os.path.join(folder, d), exclude))
            paths += [os.path.join(folder, f) for f in files if f.lower().endswith(IMAGE_EXTS)]
        return sorted(paths), spec
    if os.path.isfile(spec):
        return [spec], os.path.dirname(spec) or "."
    paths = sorted(p for p in glob.glob(spec, recursive=True)
                   if os.path.isfile(p) and p.lower().endswith(IMAGE_EXTS) and not inside(p, exclude))
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths]) if paths else "."
    return paths, root


def output_names(paths: Sequence[str], root: str) -> Dict[str, str]:
    """Each image's output name (relative to OUT_DIR, without suffix): its relative path
    without the extension, or with it where two images would share a name (``x0.jpg`` and
    ``x0.png`` -> ``x0.jpg`` and ``x0.png``, never one ``x0.npz`` for both). Names are compared
    case-insensitively (macOS and Windows folders). Raises ``ValueError`` if names still collide."""
    rel = {p: os.path.relpath(p, root) for p in paths}
    stems = {p: os.path.splitext(r)[0] for p, r in rel.items()}
    count: Dict[str, int] = {}
    for stem in stems.values():
        count[stem.lower()] = count.get(stem.lower(), 0) + 1
    names = {p: stems[p] if count[stems[p].lower()] == 1 else rel[p] for p in paths}
    seen: Dict[str, str] = {}
    for p, name in names.items():
        other = seen.setdefault(name.lower(), p)
        if other != p:
            raise ValueError(f"input: {other!r} and {p!r} would write the same outputs ({name}.*) in OUT_DIR; "
                             "rename one of them")
    return names

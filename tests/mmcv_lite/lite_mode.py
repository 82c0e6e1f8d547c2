"""Run a Python script (or ``-c CODE``) as if mmcv had no compiled ops (mmcv-lite), in an environment that has them.

    python tests/mmcv_lite/lite_mode.py SCRIPT [ARGS...]
    python tests/mmcv_lite/lite_mode.py -c CODE [ARGS...]

A ``sys.meta_path`` finder hides ``mmcv._ext`` before anything imports mmcv, so the import of
``swin_backbone`` finds mmcv without its compiled extension and switches the stand-in on, exactly
as on an mmcv-lite install. Tests use it on the torch 2.1 stack to train the same model both ways
in separate processes. (On an mmcv-lite install there is nothing to hide: it changes nothing.)
"""
import importlib.abc
import os
import runpy
import sys

HIDDEN = "mmcv._ext"


class HideCompiledOps(importlib.abc.MetaPathFinder):
    """Asks the finders it wraps for every module except :data:`HIDDEN`, which it reports as
    absent (a finder in front of the others cannot do that: ``None`` passes the question on)."""

    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, fullname, path=None, target=None):
        if fullname == HIDDEN:
            return None
        for finder in self.finders:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the meta path finders
        for finder in self.finders:
            if hasattr(finder, "find_distributions"):
                yield from finder.find_distributions(*args, **kwargs)

    def invalidate_caches(self):
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


def install() -> None:
    if HIDDEN in sys.modules or any(isinstance(f, HideCompiledOps) for f in sys.meta_path):
        return
    sys.meta_path[:] = [HideCompiledOps(list(sys.meta_path))]


if __name__ == "__main__":
    install()
    if sys.argv[1] == "-c":  # python lite_mode.py -c CODE [ARGS...]
        code, sys.argv = sys.argv[2], ["-c"] + sys.argv[3:]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    else:
        script, sys.argv = sys.argv[1], sys.argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")

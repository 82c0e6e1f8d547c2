"""Build hooks only (the metadata is in setup.cfg): the wheel ships ``swin_backbone_mmcv_ext.pth``,
one line that puts mmcv-lite's ``_ext`` finder (``_swin_backbone_mmcv_ext``) at the end of
``sys.meta_path`` at interpreter start, so mmcv finds its ops whoever imports ``mmcv.ops`` first.

The line is added to the build (``build_py``) and to the editable wheel (setuptools' PEP 660
``editable_wheel`` builds no build_lib), so it lands in the wheel's RECORD and ``pip uninstall``
removes it. ``.pth`` files run in name order: this one sorts after setuptools' ``__editable__.*``
ones, which make the finder module importable in an editable install.
"""
import os
import zipfile

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "swin_backbone_mmcv_ext.pth"
PTH_LINE = "import _swin_backbone_mmcv_ext; _swin_backbone_mmcv_ext.install()\n"


class BuildPyWithPth(build_py):
    """build_py, plus the ``.pth`` at the top of the build (the wheel's root: site-packages)."""

    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, PTH_NAME), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


cmdclass = {"build_py": BuildPyWithPth}

try:  # setuptools >= 64 (PEP 660); older ones install editable through `develop` (no .pth: import swin_backbone)
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        """The editable wheel, with the ``.pth`` added (pip records every file it installs)."""

        def run(self):
            super().run()
            for name in os.listdir(self.dist_dir):
                if name.endswith(".whl") and "editable" in name:
                    with zipfile.ZipFile(os.path.join(self.dist_dir, name), "a") as wheel:
                        if PTH_NAME not in wheel.namelist():
                            wheel.writestr(PTH_NAME, PTH_LINE)

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:
    pass

setup(cmdclass=cmdclass)

"""Building the package as a user gets it and running commands in fresh venvs (tests/test_install.py,
tests/tools/test_plain_install_scripts.py; the ``wheel`` fixture is in conftest.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from .helpers import ROOT

# Left out of the copy the wheel is built from (what .gitignore keeps out of a clone).
NOT_SOURCE = {".git", ".venv", "build", "dist", "data", "work_dirs", "outputs", "checkpoints", ".pytest_cache"}


def run(cmd, cwd, timeout=900, env=None):
    """Run ``cmd``; on failure raise with its output. A clean environment: nothing from the
    checkout or the test's own venv leaks in."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    base.update(OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONWARNINGS="ignore")
    base.update(env or {})
    proc = subprocess.run(cmd, cwd=cwd, env=base, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout + proc.stderr


def last(out: str, tag: str) -> str:
    """The text after ``tag`` on the last line of ``out`` that starts with it."""
    return [line[len(tag):] for line in out.splitlines() if line.startswith(tag)][-1]


class Venv:
    def __init__(self, path: str, work: str):
        self.path, self.work = path, work
        self.python = os.path.join(path, "bin", "python")

    def pip(self, *args, timeout=900):
        return run([self.python, "-m", "pip", "--disable-pip-version-check", *args], self.work, timeout)

    def py(self, code: str, *args, env=None):
        """Run ``code`` in the venv (cwd: a scratch dir, so only installed packages import)."""
        return run([self.python, "-c", textwrap.dedent(code), *args], self.work, env=env)

    def installed(self):
        out = run([self.python, "-m", "pip", "list", "--format", "json"], self.work, env=dict(PYTHONWARNINGS="ignore"))
        return {row["name"].lower(): row["version"] for row in json.loads(out.strip().splitlines()[0])}


def build_wheel(tmp) -> str:
    """The wheel, built like ``pip wheel .`` into ``tmp/dist`` from a copy of the source tree in
    ``tmp/src`` (the checkout's own build/ and egg-info can hold stale files)."""
    src = tmp / "src"

    def ignore(folder, names):
        top = os.path.abspath(folder) == ROOT
        return [n for n in names if (top and (n in NOT_SOURCE or n.startswith(".venv"))) or n == "__pycache__"
                or n.endswith(".egg-info")]

    shutil.copytree(ROOT, src, ignore=ignore, symlinks=True)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
         str(src)], str(tmp))
    wheels = list((tmp / "dist").glob("swin_backbone-*.whl"))
    assert len(wheels) == 1, wheels
    return str(wheels[0])

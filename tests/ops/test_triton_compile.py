"""The fused Triton kernel compiles cleanly for every GPU target it is allowed on.

Triton's compiler and the ptxas it bundles run on the CPU: this builds every launch variant of
:mod:`swin_backbone.ops.triton_attention` (:func:`launch_variants`: fp32 with and without TF32
dots, fp16, bf16, forward and backward, the one block shape and ``num_warps``) for every target
in :data:`COMPILE_TARGETS` (sm_80, sm_86, sm_89, sm_90) with the installed Triton, exactly as a
launch would (integer arguments unspecialized, pointers 16-byte aligned), and fails on a
compiler error, a compiler abort (an LLVM abort kills the process: cases run in worker
processes that are restarted after one) or a register spill above :data:`SPILL_BOUND` bytes per
thread. ``static_reason`` admits exactly these targets, so a target joins the gate by joining
the table and passing here. Figures: docs/gpu-kernel.md.
"""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (the kernel is declined without it)")

from swin_backbone.ops import triton_attention as ta  # noqa: E402
from swin_backbone.torch_compat import parse_version  # noqa: E402

TRITON_VERSION = parse_version(triton.__version__)

#: Largest spill store per thread (bytes, ptxas) a variant may have. Measured with Triton 3.8:
#: 0-56 B for fp16 / bf16 / TF32 and the forwards, about 800 B for the fp32 (no TF32) backward,
#: whose dots run on FMA units; the dK^T / dV^T form it replaced spilled 7-9 KB.
SPILL_BOUND = 1024

#: Compiles run in this many worker processes (the CI machines have 2 cores).
WORKERS = 2

ROOT = Path(__file__).resolve().parents[2]

#: One worker: compiles the cases given as JSON in argv[1], printing a JSON line before and
#: after each (so that an abort inside a compile names the case it happened in).
WORKER = r"""
import contextlib, io, json, os, re, subprocess, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from swin_backbone.ops import triton_attention as ta
from swin_backbone.torch_compat import parse_version

fn = JITFunction(ta._window_attention_kernel)
NEW_SIGNATURE = parse_version(triton.__version__) >= (3, 3)
knobs = getattr(triton, "knobs", None)
ptxas_log = knobs is not None and hasattr(knobs.nvidia, "dump_ptxas_log")
if ptxas_log:
    knobs.nvidia.dump_ptxas_log = True


def signature(ty):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name.isupper():
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in ("table_ptr", "dbias_ptr") else "*" + ty
            if hasattr(BaseBackend, "parse_attr"):  # Triton >= 3.3: the aligned pointers of a launch
                attrs[(i,)] = BaseBackend.parse_attr("D")
        else:
            sig[name] = "fp32" if name.endswith("scale") else "i32"
    return sig, attrs


def ptxas_v(kernel, arch):  # no ptxas log knob (Triton < 3.5): run the wheel's ptxas on the PTX
    from triton.backends.nvidia import compiler as nvidia
    if not hasattr(nvidia, "get_ptxas"):  # Triton < 3.3
        ptxas = nvidia._path_to_binary("ptxas")[0]
    else:
        try:
            tool = nvidia.get_ptxas(arch)  # Triton 3.3: (path, version)
        except TypeError:
            tool = nvidia.get_ptxas()  # Triton 3.4: a knob with .path
        ptxas = tool.path if hasattr(tool, "path") else tool[0]
    path = os.path.join(os.environ["TRITON_CACHE_DIR"], "check.ptx")
    with open(path, "w") as f:
        f.write(kernel.asm["ptx"])
    arch = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"  # as Triton builds it (wgmma needs sm_90a)
    run = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", path, "-o", path + ".o"], capture_output=True, text=True)
    return run.stderr


for arch, ty, precision, backward in json.loads(sys.argv[1]):
    print(json.dumps(dict(start=[arch, ty, precision, backward])), flush=True)
    constants = dict(BLOCK_N=ta.BLOCK_N, BLOCK_D=ta.BLOCK_D, INPUT_PRECISION=precision, BACKWARD=backward)
    sig, attrs = signature(ty)
    options = dict(num_warps=ta.NUM_WARPS, num_stages=ta.NUM_STAGES)
    log = io.StringIO()
    target = GPUTarget("cuda", arch, 32)
    if not NEW_SIGNATURE:  # Triton < 3.3: the signature holds runtime arguments only
        sig = {n: t for n, t in sig.items() if t != "constexpr"}
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, sig, constants, attrs or None), target=target, options=options)
        text = log.getvalue() if ptxas_log else ptxas_v(kernel, arch)
        spills = re.search(r"(\d+) bytes spill stores", text)
        registers = re.search(r"Used (\d+) registers", text)
        ptx = kernel.asm["ptx"]
        result = dict(ok=True, spills=int(spills.group(1)) if spills else None,
                      registers=int(registers.group(1)) if registers else None,
                      mma=len(re.findall(r"\bmma\.sync", ptx)), wgmma=len(re.findall(r"wgmma\.mma_async", ptx)))
    except Exception as error:
        result = dict(ok=False, error=f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")
    print(json.dumps(result), flush=True)
"""

Case = Tuple[int, str, str, bool]


def _cases() -> List[Case]:
    return [(arch, ty, precision, backward) for arch in ta.COMPILE_TARGETS
            for ty, precision, backward in ta.launch_variants()]


def _run_worker(cases: List[Case], env: Dict[str, str], results: Dict[Case, dict]) -> None:
    """Compile ``cases`` in worker processes, one after another, restarting after an abort."""
    while cases:
        run = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cases)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        current = None
        for line in run.stdout.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "start" in record:
                current = tuple(record["start"])
            elif current is not None:
                results[current] = record
                current = None
        if current is None and len(results) < len(cases) and run.returncode != 0 and not any(
                case in results for case in cases):
            current = tuple(cases[0])  # died before its first case (an import error): blame it, go on
        if current is not None:  # the process died inside this case
            results[current] = dict(ok=False, error=f"compiler process died (exit code {run.returncode}): "
                                                    + " ".join(run.stderr.split())[-300:])
        cases = [c for c in cases if tuple(c) not in results]


@pytest.fixture(scope="module")
def compile_matrix(tmp_path_factory) -> Dict[Case, dict]:
    if TRITON_VERSION < (3, 0):
        pytest.skip(f"triton {getattr(ta.triton, '__version__', '(not installed)')} < 3.0: the kernel needs "
                    "tl.dot(input_precision=) and is declined")
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    home = tmp_path_factory.mktemp("triton")
    results: Dict[Case, dict] = {}
    cases = _cases()
    threads = []
    for i in range(WORKERS):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
        env.update(TRITON_CACHE_DIR=str(home / f"cache{i}"), TRITON_HOME=str(home), PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        threads.append(threading.Thread(target=_run_worker, args=(cases[i::WORKERS], env, results)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _label(case: Case) -> str:
    arch, ty, precision, backward = case
    name = "tf32" if precision == "tf32" else ty
    return f"sm_{arch} {name} {'backward' if backward else 'forward'}"


def test_every_launch_variant_compiles_cleanly_for_every_allowed_target(compile_matrix):
    lines, failures = [], []
    for case in _cases():
        result = compile_matrix.get(case, dict(ok=False, error="no result"))
        if not result["ok"]:
            failures.append(f"{_label(case)}: {result['error']}")
            continue
        lines.append(f"{_label(case)}: {result['registers']} registers, {result['spills']} B spill stores, "
                     f"{result['mma']} mma.sync, {result['wgmma']} wgmma")
        if result["spills"] is None:
            failures.append(f"{_label(case)}: no ptxas report of spills")
        elif result["spills"] > SPILL_BOUND:
            failures.append(f"{_label(case)}: {result['spills']} bytes of spill stores per thread > {SPILL_BOUND}")
    print(f"triton {triton.__version__}\n" + "\n".join(lines))  # the matrix (pytest -s shows it)
    assert not failures, "\n".join(failures)
    # Tensor-core dots where they belong: 16-bit and TF32 use mma.sync or wgmma, fp32 FMA.
    for case in _cases():
        arch, ty, precision, _ = case
        tensor_cores = compile_matrix[case]["mma"] + compile_matrix[case]["wgmma"]
        assert (tensor_cores > 0) == (ty != "fp32" or precision == "tf32"), (_label(case), compile_matrix[case])


def test_the_gate_admits_what_compiled_and_this_triton(compile_matrix):
    # The capability gate is COMPILE_TARGETS itself; the installed Triton must be one the gate
    # admits (a new one: add it to TRITON_VERSIONS once the matrix above passes with it).
    version = TRITON_VERSION
    assert version in ta.TRITON_VERSIONS, (
        f"triton {triton.__version__} is not in TRITON_VERSIONS {ta.TRITON_VERSIONS}: add it if the compile matrix "
        "above is clean")
    assert {case[0] for case in compile_matrix} == set(ta.COMPILE_TARGETS)

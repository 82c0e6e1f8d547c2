"""Which window-attention kernel runs on this GPU: verified and measured at first use.

For each attention :class:`Signature` (never the input size) the first call checks every
candidate (the fused Triton kernel, SDPA) against a float32 reference on its own inputs, times
the ones that pass and keeps the fastest (:func:`measure`, :func:`decide`). Decisions persist
in the user's cache directory (:func:`cache_path`), ranks adopt rank 0's (:class:`Decisions`),
and nothing is measured while tracing or capturing: docs/design.md, "The kernel on a GPU".
:func:`measure` takes its candidates, reference and timer as arguments, so it is tested on the
CPU with injected candidates.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

#: Values of the backbones' ``attention`` argument and of :data:`ENV_VAR`.
ATTENTION_CHOICES = ("auto", "sdpa", "triton")

#: Environment variable that overrides every backbone's ``attention`` argument.
ENV_VAR = "SWIN_BACKBONE_ATTENTION"

#: ``0`` / ``off``: decisions are neither read from nor written to the cache file.
CACHE_ENV_VAR = "SWIN_BACKBONE_ATTENTION_CACHE"

#: Largest error allowed, relative to the reference's largest magnitude, per compute dtype
#: (``float32`` with TF32 matmuls as ``'tf32'``). Loose enough for the kernels' rounding,
#: far below what a wrong mask, bias or transposed tile gives (errors of order 1).
TOLERANCE = {"float32": 1e-4, "tf32": 5e-3, "float16": 5e-3, "bfloat16": 3e-2, "float64": 1e-9}

Outputs = Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


def resolve_attention(value: object, name: str = "attention") -> str:
    """The attention mode in force: :data:`ENV_VAR` if set, else ``value``.

    Raises ``ValueError`` naming ``name`` (or the variable) for anything but
    :data:`ATTENTION_CHOICES`."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        if env not in ATTENTION_CHOICES:
            raise ValueError(f"{ENV_VAR}: expected one of {ATTENTION_CHOICES}, got {env!r}")
        return env
    if not isinstance(value, str) or value not in ATTENTION_CHOICES:
        raise ValueError(f"{name}: expected one of {ATTENTION_CHOICES}, got {value!r}")
    return value


@dataclass(frozen=True)
class Signature:
    """What a kernel decision depends on (never the input size)."""

    device: str  #: GPU name and compute capability, e.g. ``'NVIDIA H100 80GB HBM3 sm_90'``
    dtype: str  #: compute dtype, ``'bfloat16'``
    precision: str  #: fp32 matmul precision ``'ieee'`` / ``'tf32'``; ``'-'`` for 16-bit dtypes
    window: int
    num_heads: int
    head_dim: int
    training: bool  #: forward and backward (else forward only)
    valid_sizes: bool  #: per-image valid sizes (windows cut by images' edges redone by SDPA)

    def key(self) -> str:
        mode = "train" if self.training else "eval"
        valid = " valid_sizes" if self.valid_sizes else ""
        return (f"{self.device} | {self.dtype}/{self.precision} window {self.window} "
                f"{self.num_heads}x{self.head_dim} {mode}{valid}")

    def without_valid_sizes(self) -> "Signature":
        return Signature(**dict(asdict(self), valid_sizes=False))


@dataclass(frozen=True)
class Candidate:
    """One way to compute the attention: ``run(inputs)`` returns row-major output and, in
    training, the gradients of ``qkv`` and of the table from one backward."""

    name: str  #: ``'triton/warps8'``, ``'sdpa'``
    kernel: str  #: the plan's kernel name: ``'triton'`` or ``'sdpa'``
    run: Callable[[], Outputs]
    warps: int = 0  #: Triton ``num_warps`` (0: not a Triton candidate)


@dataclass
class Choice:
    """A decision: the kernel (and Triton launch setting) for one signature, and why."""

    kernel: str
    warps: int = 0
    times_ms: Dict[str, float] = field(default_factory=dict)
    errors: Dict[str, float] = field(default_factory=dict)  #: verified: largest relative error
    rejected: Dict[str, str] = field(default_factory=dict)  #: candidate -> reason
    source: str = "measured"  #: measured / cache / rank 0 / inherited / verified / forced

    def describe(self) -> str:
        times = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(self.times_ms.items(), key=lambda kv: kv[1]))
        rejected = "; ".join(f"{k} rejected: {v}" for k, v in self.rejected.items())
        chosen = self.kernel + (f" (num_warps={self.warps})" if self.warps else "")
        return f"{chosen} [{self.source}]" + (f"; {times}" if times else "") + (f"; {rejected}" if rejected else "")


# ------------------------------------------------------------------------------ selection


def relative_error(got: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> float:
    """``max |got - ref| / max |ref|`` in float64 (``inf`` for non-finite or missing values)."""
    if got is None or ref is None:
        return 0.0 if got is None and ref is None else float("inf")
    if got.shape != ref.shape:
        return float("inf")
    got, ref = got.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return float((got - ref).abs().max()) / max(scale, 1e-30) if got.numel() else 0.0


def verify(candidate: Candidate, reference: Outputs, tolerance: float) -> Tuple[Optional[float], Optional[str]]:
    """Run ``candidate`` once; ``(largest relative error, None)`` if it matches ``reference``
    within ``tolerance`` on the output and every gradient, else ``(error, reason)``."""
    try:
        got = candidate.run()
    except Exception as error:  # noqa: BLE001 - any failure of a candidate rejects it
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"{type(error).__name__}: {first}"[:300]
    worst, reasons = 0.0, []
    for what, g, r in zip(("output", "grad qkv", "grad table"), got, reference):
        err = relative_error(g, r)
        worst = max(worst, err)
        if not err <= tolerance:
            reasons.append(f"{what} off by {err:.2e} (relative; tolerance {tolerance:.0e})")
    return worst, "; ".join(reasons) or None


def measure(candidates: Sequence[Candidate], reference: Callable[[], Outputs], tolerance: float,
            timer: Callable[[Callable[[], Outputs]], float], time_candidates: bool = True) -> Choice:
    """Verify every candidate against ``reference()``, time those that pass with ``timer``
    (milliseconds), and choose the fastest (the first that passed if not timed).

    No candidate passing gives ``Choice('plain')`` (matmul + softmax with autograd)."""
    ref = reference()
    errors: Dict[str, float] = {}
    rejected: Dict[str, str] = {}
    passed: List[Candidate] = []
    for c in candidates:
        err, reason = verify(c, ref, tolerance)
        if reason is None:
            errors[c.name] = float(err)
            passed.append(c)
        else:
            rejected[c.name] = reason
    if not passed:
        return Choice("plain", errors=errors, rejected=rejected)
    times: Dict[str, float] = {}
    if time_candidates and len(passed) > 1:
        times = {c.name: float(timer(c.run)) for c in passed}
        best = min(passed, key=lambda c: times[c.name])
    else:
        best = passed[0]
    return Choice(best.kernel, best.warps, times, errors, rejected, "measured" if times else "verified")


def cuda_timer(fn: Callable[[], object], warmup: int = 1, repeat: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (CUDA events, after ``warmup``)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ------------------------------------------------------------------------------ the decisions


def _log(message: str, level: int = logging.INFO) -> None:
    from mmengine.logging import print_log

    print_log(f"SwinBackbone attention: {message}", logger="current", level=level)


def _distributed() -> Tuple[bool, int]:
    """``(several ranks, this rank)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True, dist.get_rank()
    return False, 0


def cache_path() -> str:
    """The persisted decisions: ``$SWIN_BACKBONE_CACHE`` or ``$XDG_CACHE_HOME/swin-backbone``
    (``~/.cache/swin-backbone``), file ``attention-choices.json``."""
    root = os.environ.get("SWIN_BACKBONE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "swin-backbone"
    )
    return os.path.join(root, "attention-choices.json")


def version_key() -> str:
    """What invalidates persisted decisions: GPU, driver, torch, CUDA, triton, this package."""
    from .._version import __version__
    from .triton_attention import triton

    parts = [f"torch {torch.__version__}", f"cuda {torch.version.cuda}", f"swin_backbone {__version__}"]
    parts.append(f"triton {getattr(triton, '__version__', None)}")
    if torch.cuda.is_available():
        parts.append(f"gpus {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
        parts.append(f"driver {_driver_version()}")
    return " | ".join(parts)


def _driver_version() -> Optional[str]:
    try:
        import ctypes

        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return str(version.value)
    except (OSError, AttributeError):
        return None


def _read_json(path: str) -> dict:
    """The JSON object in the file ``path`` (``{}`` if it holds another value)."""
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class Decisions:
    """This process's decisions, and the file they persist in (one per process: :data:`DECISIONS`)."""

    def __init__(self) -> None:
        self.choices: Dict[Signature, Choice] = {}
        self.synced: set = set()  # (device, dtype) modes whose decisions came from rank 0
        self._file: Optional[dict] = None

    # ---------------------------------------------------------------- the file
    def _persist(self) -> bool:
        return os.environ.get(CACHE_ENV_VAR, "1").strip().lower() not in ("0", "off", "false", "no")

    def _load(self) -> dict:
        """This version key's entries of the cache file (``{}`` if absent, unreadable or off)."""
        if self._file is None:
            self._file = {"choices": {}, "pending": []}
            many, rank = _distributed()
            # Under torch.distributed only rank 0 uses the file (the others adopt its decisions).
            if self._persist() and not (many and rank != 0):
                try:
                    entry = _read_json(cache_path()).get(version_key())
                    if isinstance(entry, dict):
                        self._file = {"choices": dict(entry.get("choices", {})),
                                      "pending": list(entry.get("pending", []))}
                except FileNotFoundError:
                    pass
                except (OSError, ValueError) as error:
                    _log(f"ignoring unreadable {cache_path()} ({error})", logging.WARNING)
        return self._file

    def _save(self) -> None:
        """Write this version key's entries (atomically; other keys' entries are kept)."""
        many, rank = _distributed()
        if not self._persist() or (many and rank != 0):
            return
        path = cache_path()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                data = _read_json(path)
            except (OSError, ValueError):
                data = {}
            data[version_key()] = self._load()
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".attention-choices.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as error:
            _log(f"could not write {path} ({error}); decisions are kept in this process only", logging.WARNING)

    def persisted(self, sig: Signature) -> Optional[Choice]:
        entry = self._load()["choices"].get(sig.key())
        if not isinstance(entry, dict) or entry.get("kernel") not in ("triton", "sdpa", "plain"):
            return None
        return Choice(entry["kernel"], int(entry.get("warps", 0)), dict(entry.get("times_ms", {})),
                      dict(entry.get("errors", {})), dict(entry.get("rejected", {})), "cache")

    def died_verifying(self, sig: Signature) -> bool:
        """Whether a process stopped while the fused kernel ran for ``sig`` the first time."""
        return sig.key() in self._load()["pending"]

    @contextlib.contextmanager
    def pending(self, sig: Signature) -> Iterator[None]:
        """Mark ``sig`` pending in the file while the fused kernel runs for it the first time."""
        file = self._load()
        file["pending"] = sorted(set(file["pending"]) | {sig.key()})
        self._save()
        try:
            yield
        finally:
            file["pending"] = [k for k in file["pending"] if k != sig.key()]
            self._save()

    def record(self, sig: Signature, choice: Choice) -> None:
        """Keep ``choice`` for ``sig`` in the process and (measured ones) in the file."""
        self.choices[sig] = choice
        if choice.source in ("measured", "verified", "fallback"):
            entry = {k: v for k, v in asdict(choice).items() if k != "source"}
            self._load()["choices"][sig.key()] = entry
            self._save()

    def forget(self, persisted: bool = True) -> None:
        """Drop every decision of this process (and, with ``persisted``, the cache file)."""
        self.choices.clear()
        self.synced.clear()
        self._file = None
        if persisted:
            with contextlib.suppress(FileNotFoundError):
                os.remove(cache_path())

    # ---------------------------------------------------------------- ranks
    def sync_after_forward(self, device: str, dtype: torch.dtype, training: bool) -> None:
        """At the end of a model forward: the first training forward of each (device, dtype)
        adopts rank 0's decisions on every rank (one collective, reached by all ranks)."""
        many, rank = _distributed()
        mode = (device, str(dtype))
        if not many or not training or mode in self.synced:
            return
        self.synced.add(mode)
        payload = [{sig: choice for sig, choice in self.choices.items()} if rank == 0 else None]
        torch.distributed.broadcast_object_list(payload, src=0)
        for sig, choice in payload[0].items():
            mine = self.choices.get(sig)
            if mine is None or (mine.kernel, mine.warps) != (choice.kernel, choice.warps):
                self.choices[sig] = replace(choice, source="rank 0")

    def sibling(self, sig: Signature) -> Optional[Choice]:
        """The decision of ``sig`` without ``valid_sizes`` (what ranks agreed on), if any."""
        return self.choices.get(sig.without_valid_sizes()) if sig.valid_sizes else None


#: The decisions of this process.
DECISIONS = Decisions()


def forget(persisted: bool = True) -> None:
    """Forget every kernel decision (``persisted``: delete the cache file too)."""
    DECISIONS.forget(persisted)


def decide(sig: Signature, candidates: Callable[[], Sequence[Candidate]], reference: Callable[[], Outputs],
           timer: Callable[[Callable[[], Outputs]], float] = cuda_timer, forced: bool = False) -> Choice:
    """The kernel for ``sig``: decided before, persisted, or measured now on the candidates.

    ``forced`` (``attention='triton'``): the only candidate is the fused kernel, verified
    once; a failure raises ``RuntimeError`` naming the reason instead of falling back."""
    known = DECISIONS.choices.get(sig)
    if known is not None:
        return known
    many, _ = _distributed()
    cached = None if forced else DECISIONS.persisted(sig)
    if cached is not None:
        DECISIONS.choices[sig] = cached
        return cached
    options, rejected = list(candidates()), {}
    dead = DECISIONS.died_verifying(sig)
    if forced:
        options = [c for c in options if c.kernel == "triton"][:1]
    elif dead:
        reason = f"a previous run stopped while verifying it (delete {cache_path()} to try again)"
        rejected = {c.name: reason for c in options if c.kernel == "triton"}
        options = [c for c in options if c.kernel != "triton"]
    sibling = DECISIONS.sibling(sig) if many and not forced else None
    if sibling is not None:
        options = [c for c in options if (c.kernel, c.warps) == (sibling.kernel, sibling.warps)] or options
    tolerance = TOLERANCE.get(sig.dtype if sig.precision != "tf32" else "tf32", 3e-2)
    # Under torch.distributed, signatures met after the ranks agreed are verified, not timed.
    late = many and not forced and DECISIONS.synced
    with DECISIONS.pending(sig) if any(c.kernel == "triton" for c in options) else contextlib.nullcontext():
        choice = measure(options, reference, tolerance, timer, time_candidates=not late)
    choice.rejected.update(rejected)
    if sibling is not None:
        choice.source = "inherited"
    if forced:
        choice.source = "forced"
        if choice.kernel != "triton":
            raise RuntimeError(f"attention='triton': the fused Triton kernel cannot run {sig.key()}: "
                               + "; ".join(choice.rejected.values()))
    DECISIONS.record(sig, choice)
    level = logging.WARNING if choice.rejected else logging.INFO
    _log(f"{sig.key()}: {choice.describe()}", level)
    return choice


def reject(sig: Signature, error: object) -> None:
    """The fused kernel failed at run time for ``sig`` (a launch the measurement did not
    meet): SDPA from now on, with one warning, persisted."""
    old = DECISIONS.choices.get(sig)
    if old is not None and old.kernel != "triton":
        return
    reason = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    choice = Choice("sdpa", rejected={"triton": f"failed at run time ({reason.splitlines()[0][:300]})"},
                    source="fallback")
    DECISIONS.record(sig, choice)
    _log(f"{sig.key()}: {choice.describe()}", logging.WARNING)


def known(sig: Signature) -> Optional[Choice]:
    """The decision already made for ``sig`` in this process (no measurement)."""
    return DECISIONS.choices.get(sig)


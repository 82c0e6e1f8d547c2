"""Checkpoint references that are not local paths: what mmengine's ``CheckpointLoader`` accepts.

=================================== ==================================================================
``http://`` / ``https://`` URL       downloaded once into ``torch.hub.get_dir()/checkpoints``
                                     (``$TORCH_HOME/hub/...``, the folder mmengine's and torch's
                                     ``load_url`` use), read from there afterwards with no network
``torchvision://NAME``              mmengine's table of torchvision's weights (``modelzoo://``: the
                                     old spelling), then as a URL
``open-mmlab://NAME``               mmengine's OpenMMLab table (``$MMENGINE_HOME/open_mmlab.json``
                                     overrides it; deprecated names followed), then as a URL or a file
                                     under ``$MMENGINE_HOME``
``mmcls://NAME``                    mmengine's mmcls table, then as a URL
other prefixes of ``CheckpointLoader`` storage backends (``s3://``, ``petrel://``, ``pavi://``, any
                                     scheme registered with ``CheckpointLoader.register_scheme``):
                                     mmengine's loader reads it; conversion and report are ours
=================================== ==================================================================

The cache (docs/checkpoints.md, "The download cache"):

- **A cached file holds the URL it was asked for.** Each download records its source beside
  it (``<name>.json``: URL, size, sha256, ETag). A URL is cached under its file name, as torch
  and mmengine name it, unless that name is ambiguous (a query string, no extension, a generic
  hub name, an mmengine run name such as ``epoch_12.pth``) or already records another URL:
  then under ``<sha256(url)[:12]>-<name>``. A file without a record (torch or mmengine
  downloaded it) is used for the unambiguous names only.
- **One download per file** across threads, processes, ranks and jobs sharing the cache:
  ``fcntl.flock`` on ``<name>.lock`` around check -> download -> rename. No collective: it
  works before a process group exists and when only some ranks read.
- **No hang, a retry:** a per-read timeout and retries with backoff (:func:`download_settings`),
  then an error naming the URL.
- The download goes to a staging file beside the cached one, is checked (``Content-Length``,
  a sha256 prefix the name carries where its publisher guarantees it, readable as a
  checkpoint) and only then renamed into place: nothing half-written or foreign reaches the cache.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import http.client
import json
import os
import re
import socket
import time
import urllib.error
import uuid
from typing import Dict, Iterator, Optional, Tuple, Union
from urllib.parse import urlparse
from urllib.request import Request, urlopen

import torch

from .base import CheckpointError
from .files import read_file

try:  # POSIX; elsewhere downloads are not serialised across processes
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

URL_PREFIXES = ("http://", "https://")
#: mmengine's name tables: prefix -> (what the names are, how to get a name's URL).
NAMED_PREFIXES = ("torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")
#: File names that many sources share (Hugging Face hub files, other frameworks' run names):
#: never cached under the bare name.
GENERIC_NAMES = ("model.safetensors", "pytorch_model.bin", "model.bin", "model.pth", "model.pt", "checkpoint.pth",
                 "model_final.pth", "latest.pth")
#: mmengine's CheckpointHook names (``epoch_12.pth``, ``iter_160000.pth``, ``best_coco_bbox_mAP_epoch_36.pth``):
#: every experiment has them.
RUN_NAME = re.compile(r"^(?:(?:epoch|iter)_\d+|best_.+)\.pth$")
#: A sha256 prefix in a file name, as torch's ``HASH_REGEX`` (``swin_t-704ceda3.pth``), 8 hex digits at least.
HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[A-Za-z0-9]+$")
#: Hosts whose file names' hash prefixes are guaranteed (torchvision loads them with
#: ``check_hash=True``); OpenMMLab's are not (mim dropped its check, open-mmlab/mim#11).
HASHED_HOSTS = ("download.pytorch.org",)

#: Settings from the environment: name -> (default, what it is).
SETTINGS = {
    "SWIN_BACKBONE_DOWNLOAD_TIMEOUT": (60.0, "seconds without a byte from the server before a try fails"),
    "SWIN_BACKBONE_DOWNLOAD_RETRIES": (3, "tries after the first on a timeout, a dropped connection, HTTP 5xx / 429"),
    "SWIN_BACKBONE_DOWNLOAD_BACKOFF": (1.0, "seconds before the first retry, doubled for each further one"),
}
#: HTTP answers worth another try (a Retry-After header is honoured, up to :data:`MAX_RETRY_AFTER`).
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
MAX_RETRY_AFTER = 60.0
#: A torch / mmengine ``.partial`` file not written to for this long belongs to a dead download.
STALE_PARTIAL_S = 3600
READ_CHUNK = 1 << 20


def is_reference(checkpoint: str) -> bool:
    """``checkpoint`` names something other than a local path (it has a ``scheme://``)."""
    return "://" in checkpoint


def cache_dir() -> str:
    """Where URLs are cached: ``torch.hub.get_dir()/checkpoints`` (``$TORCH_HOME/hub/checkpoints``),
    the folder torch's and mmengine's ``load_url`` use."""
    return os.path.join(torch.hub.get_dir(), "checkpoints")


def download_settings() -> Dict[str, float]:
    """``{'timeout': s, 'retries': n, 'backoff': s}`` from :data:`SETTINGS` (environment
    variables, else the defaults); a value that is not a number >= 0 is a :class:`CheckpointError`."""
    out = {}
    for var, (default, what) in SETTINGS.items():
        raw = os.environ.get(var, "")
        try:
            value = type(default)(raw) if raw.strip() else default
        except ValueError:
            value = -1
        if value < 0 or (var.endswith("TIMEOUT") and value == 0):
            kind = "an integer >= 0" if isinstance(default, int) else "a number > 0" if var.endswith("TIMEOUT") \
                else "a number >= 0"
            raise CheckpointError(f"${var}: expected {kind} ({what}; default {default}), got {raw!r}")
        out[var.rsplit("_", 1)[1].lower()] = value
    return out


# ---------------------------------------------------------------- names and records
def _url_hash(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:12]


def _name(url: str) -> str:
    name = os.path.basename(urlparse(url).path)
    if not name:
        raise CheckpointError(f"checkpoint {url!r}: the URL names no file (its path ends in '/'); "
                              "expected the URL of a checkpoint file")
    return name


def is_ambiguous(url: str) -> bool:
    """Whether ``url``'s file name may well name other files too: a query string
    (``uc?id=...``), no extension (``.../files/123/content``), a generic hub name
    (:data:`GENERIC_NAMES`) or an mmengine run name (:data:`RUN_NAME`)."""
    name = _name(url)
    return bool(urlparse(url).query) or "." not in name or name.lower() in GENERIC_NAMES or bool(RUN_NAME.match(name))


def record_of(path: str) -> Optional[dict]:
    """The source record (``<path>.json``) of a cached file, or ``None`` where there is none,
    it is unreadable, or it does not describe the file (its size differs: the file was replaced)."""
    try:
        with open(path + ".json") as f:
            record = json.load(f)
        if isinstance(record, dict) and record.get("size") == os.path.getsize(path):
            return record
    except (OSError, ValueError):
        pass
    return None


def _base_file(url: str) -> str:
    """The cache path ``url`` starts from: its file name, or for ambiguous names the hashed one."""
    name = _name(url)
    return os.path.join(cache_dir(), f"{_url_hash(url)}-{name}" if is_ambiguous(url) else name)


def cached_file(url: str) -> str:
    """The cache path of ``url``: its file name, as torch's ``load_state_dict_from_url`` names it
    (so a file mmengine downloaded is found, and the reverse), or ``<sha256(url)[:12]>-<name>``
    where the name is ambiguous (:func:`is_ambiguous`) or the file there records another URL."""
    path = _base_file(url)
    if os.path.basename(path) == _name(url):
        record = record_of(path) if os.path.isfile(path) else None
        if record is not None and record.get("url") != url:
            path = os.path.join(cache_dir(), f"{_url_hash(url)}-{_name(url)}")
    return path


def expected_hash(url: str, check_hash: Optional[bool] = None) -> str:
    """The sha256 prefix a download of ``url`` must have, or '': the one its name carries
    (``name-<hex>.ext``, :data:`HASH_IN_NAME`) where ``check_hash`` is true, or (``None``) where
    its host guarantees it (:data:`HASHED_HOSTS`: torchvision's weights)."""
    m = HASH_IN_NAME.search(_name(url))
    if m is None or check_hash is False:
        return ""
    return m.group(1) if check_hash or urlparse(url).hostname in HASHED_HOSTS else ""


# ---------------------------------------------------------------- references
def resolve(checkpoint: str) -> Tuple[str, str]:
    """``(kind, where)`` for a reference: ``('url', URL)``, ``('file', local path)`` (an
    ``open-mmlab://`` name mapped to a file under ``$MMENGINE_HOME``) or ``('mmengine', ref)``
    (a storage backend that mmengine's ``CheckpointLoader`` reads).

    Raises:
        CheckpointError: a name mmengine's tables do not have, or a scheme nothing knows.
    """
    if checkpoint.startswith(URL_PREFIXES):
        return "url", checkpoint
    if checkpoint.startswith(NAMED_PREFIXES):
        return _named(checkpoint)
    from mmengine.runner.checkpoint import CheckpointLoader, load_from_local

    loader = CheckpointLoader._get_checkpoint_loader(checkpoint)
    if loader is None or loader is load_from_local:
        known = "http://, https://, torchvision://, open-mmlab://, mmcls://"
        raise CheckpointError(
            f"checkpoint {checkpoint!r}: unknown scheme {checkpoint.split('://')[0] + '://'!r}; expected a local "
            f"path, a URL or a prefix of mmengine's CheckpointLoader ({known}, s3://, petrel://, pavi://, or one "
            "registered with CheckpointLoader.register_scheme)"
        )
    return "mmengine", checkpoint


def _named(checkpoint: str) -> Tuple[str, str]:
    """A ``torchvision://`` / ``open-mmlab://`` / ``mmcls://`` name through mmengine's tables."""
    from mmengine.runner import checkpoint as mm

    prefix, name = checkpoint.split("://", 1)
    if prefix in ("torchvision", "modelzoo"):
        try:
            table = mm.get_torchvision_models()
        except ImportError as err:
            raise CheckpointError(f"checkpoint {checkpoint!r}: torchvision:// names are looked up in torchvision's "
                                  f"weight tables; install torchvision ({err})") from err
    elif prefix == "mmcls":
        table = mm.get_mmcls_models()
    else:
        table = mm.get_external_models()
        name = mm.get_deprecated_model_names().get(name, name)
    if name not in table:
        close = sorted(k for k in table if name.split(".")[0].split("_")[0] in k)[:8]
        raise CheckpointError(
            f"checkpoint {checkpoint!r}: {name!r} is not in mmengine's {prefix}:// table ({len(table)} names"
            + (f"; similar: {', '.join(close)}" if close else "") + ")"
        )
    url = table[name]
    if url.startswith(URL_PREFIXES):
        return "url", url
    return "file", os.path.join(mm._get_mmengine_home(), url)  # open-mmlab: a file under $MMENGINE_HOME


# ---------------------------------------------------------------- fetching
def fetch(checkpoint: str, map_location: Union[str, torch.device] = "cpu", progress: Optional[bool] = None,
          check_hash: Optional[bool] = None) -> Tuple[str, Optional[object]]:
    """The local file of a URL (cached, downloaded once) or of a named reference.

    A cache hit opens no connection and takes no lock (a read-only cache serves hits). A miss
    takes ``<name>.lock`` (``fcntl.flock``): one process downloads, the others wait and then
    read its file. No collective is involved: any subset of ranks, or processes without a
    process group, may call this.

    Args:
        check_hash: check the sha256 prefix a file name carries (``name-<hex>.pth``): ``True``
            always, ``False`` never, ``None`` where its host guarantees it (:func:`expected_hash`).
    Returns:
        ``(path, content)``: the local file, and what it holds where this call downloaded (and
        therefore already read) it, else ``None``.
    Raises:
        CheckpointError: unreachable host, an HTTP error, a stalled or cut-off download (after
            the retries), a wrong hash, a file that is not a checkpoint (nothing left in the
            cache), an unwritable cache folder, or a reference that is not a URL / name.
    """
    kind, where = resolve(checkpoint)
    if kind == "file":
        return where, None
    if kind != "url":
        raise CheckpointError(f"checkpoint {checkpoint!r}: read by mmengine's CheckpointLoader, not a file to fetch")
    path = cached_file(where)
    if os.path.isfile(path):
        return path, None
    base = _base_file(where)
    named = f"checkpoint {checkpoint!r}" + ("" if checkpoint == where else f" ({where})")
    _writable(named, where, os.path.dirname(base), os.makedirs, os.path.dirname(base), exist_ok=True)
    with _locked(named, where, base + ".lock"):
        path = cached_file(where)  # another process may have downloaded it (or another URL this name) meanwhile
        if os.path.isfile(path):
            return path, None
        _remove_stale(path)
        return path, _download(named, where, path, map_location, progress, expected_hash(where, check_hash))


def _writable(named: str, url: str, folder: str, call, *args, **kwargs):
    """``call(*args, **kwargs)``; an ``OSError`` is a :class:`CheckpointError` saying the cache
    folder cannot be written (e.g. a read-only shared ``$TORCH_HOME``)."""
    try:
        return call(*args, **kwargs)
    except OSError as err:
        raise _unwritable(named, url, folder, err) from None


def _unwritable(named: str, url: str, folder: str, err: OSError) -> CheckpointError:
    return CheckpointError(
        f"{named}: cannot write to the download cache {folder} ({type(err).__name__}: {err.strerror or err}); "
        f"point $TORCH_HOME at a writable folder (torch.hub.get_dir()), or download {url} elsewhere and pass its "
        "local path")


@contextlib.contextmanager
def _locked(named: str, url: str, lock: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (created if need be, never removed: removing a
    lock file that others may have open is a race). Waiting for it is logged once."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        try:  # another user's lock file: a read-only descriptor locks as well
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            raise _unwritable(named, url, os.path.dirname(lock), err) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            from mmengine.logging import print_log

            print_log(f"{named}: another process is downloading it; waiting for {lock}",
                      logger="current")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_stale(path: str) -> None:
    """Staging files of downloads that died (killed processes): ours (``<path>.*.download``; only
    one process downloads ``path`` at a time, the lock's holder) and torch's / mmengine's
    ``.partial`` files nobody has written to for :data:`STALE_PARTIAL_S`."""
    now = time.time()
    for stale in glob.glob(glob.escape(path) + ".*.download") + glob.glob(glob.escape(path) + ".*.partial"):
        try:
            if stale.endswith(".download") or now - os.path.getmtime(stale) > STALE_PARTIAL_S:
                os.remove(stale)
        except OSError:
            pass


class _Transient(Exception):
    """A try that may succeed when repeated: ``what`` says what happened."""

    def __init__(self, what: str, retry_after: Optional[float] = None) -> None:
        super().__init__(what)
        self.what, self.retry_after = what, retry_after


def _download(where: str, url: str, path: str, map_location: Union[str, torch.device],
              progress: Optional[bool], hash_prefix: str) -> object:
    """Download ``url`` to ``path`` through a staging file that must be complete, carry the
    expected hash and read as a checkpoint; then write its record and rename it into place."""
    from mmengine.logging import print_log

    settings = download_settings()
    staging = f"{path}.{uuid.uuid4().hex}.download"
    show = os.isatty(0) if progress is None else progress
    print_log(f"{where}: downloading to {path}", logger="current")
    tries = int(settings["retries"]) + 1
    try:
        for attempt in range(tries):
            try:
                headers, size, sha256 = _get(where, url, path, staging, settings["timeout"], show)
                break
            except _Transient as err:
                if attempt + 1 == tries:
                    raise CheckpointError(f"{where}: {err.what} ({_tries(tries)}); nothing was kept in the "
                                          "cache") from None
                delay = err.retry_after if err.retry_after is not None else settings["backoff"] * 2 ** attempt
                print_log(f"{where}: {err.what}; trying again in {delay:g} s ({attempt + 2} of {tries})",
                          logger="current")
                time.sleep(delay)
        if hash_prefix and not sha256.startswith(hash_prefix):
            raise CheckpointError(f"{where}: the downloaded file's sha256 is {sha256}, but its name says it starts "
                                  f"with {hash_prefix} (torch's check_hash); the file at the URL is not the one "
                                  "named, or was corrupted on the way (nothing was kept in the cache)")
        try:
            content = read_file(staging, map_location)
        except CheckpointError as err:
            detail = str(err)
            detail = detail.split(": ", 1)[1] if detail.startswith(f"checkpoint {staging!r}: ") else detail
            raise CheckpointError(
                f"{where}: the downloaded file ({size} bytes) is not a readable checkpoint: {detail}; the download "
                "was cut off or the URL does not serve a checkpoint file (nothing was kept in the cache)") from None
        record = dict(url=url, size=size, sha256=sha256, etag=headers.get("ETag"),
                      last_modified=headers.get("Last-Modified"), downloaded=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime()))
        # The record first: a reader that sees the file sees its record (both are renamed into place).
        _write_json(path + ".json", record)
        os.replace(staging, path)
        return content
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _tries(n: int) -> str:
    return "1 try" if n == 1 else f"{n} tries, $SWIN_BACKBONE_DOWNLOAD_RETRIES={n - 1}"


def _get(where: str, url: str, path: str, staging: str, timeout: float, progress: bool) -> Tuple[dict, int, str]:
    """One GET of ``url`` into ``staging``, the staging file of ``path`` (``timeout``: seconds
    each connect / read may wait).

    Returns:
        ``(headers, size, sha256 hex digest)``.
    Raises:
        _Transient: a timeout, a dropped or cut-off connection, HTTP 408 / 429 / 5xx.
        CheckpointError: another HTTP error, an unreachable host, an unwritable staging file.
    """
    host = urlparse(url).netloc
    stalled = (f"no data from {host} for {timeout:g} s ($SWIN_BACKBONE_DOWNLOAD_TIMEOUT); the server or a proxy "
               "stalled")
    f = _writable(where, url, os.path.dirname(staging), open, staging, "wb")
    try:
        try:
            response = urlopen(Request(url, headers={"User-Agent": "swin-backbone (torch.hub)"}), timeout=timeout)
        except urllib.error.HTTPError as err:
            answer = f"the server answered HTTP {err.code} {err.reason}"
            if err.code in RETRY_STATUS:
                raise _Transient(answer, _retry_after(err.headers.get("Retry-After"))) from None
            raise CheckpointError(f"{where}: {answer}; expected the checkpoint file") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (socket.timeout, TimeoutError)):
                raise _Transient(stalled) from None
            if isinstance(err.reason, (ConnectionResetError, ConnectionAbortedError, http.client.HTTPException)):
                raise _Transient(f"the connection to {host} dropped ({err.reason!r})") from None
            raise CheckpointError(f"{where}: cannot reach {host} ({err.reason}); download the file elsewhere and "
                                  f"pass its local path, or put it at {path}") from err
        except (socket.timeout, TimeoutError):
            raise _Transient(stalled) from None
        except (http.client.HTTPException, ConnectionError) as err:
            raise _Transient(f"the connection to {host} dropped ({type(err).__name__}: {err})") from None
        with response:
            headers = dict(response.headers.items())
            length = response.headers.get("Content-Length")
            expected = int(length) if length and length.isdigit() else None
            digest, size = hashlib.sha256(), 0
            bar = _progress(expected) if progress else None
            read = getattr(response, "read1", response.read)  # read1: what has arrived, so a stall counts it
            try:
                while True:
                    chunk = read(READ_CHUNK)
                    if not chunk:
                        break
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            except (socket.timeout, TimeoutError):
                raise _Transient(f"{stalled} after {size} bytes") from None
            except http.client.IncompleteRead as err:
                size += len(err.partial)
                raise _Transient(f"the connection closed after {size} of {expected} bytes (cut off)") from None
            except (http.client.HTTPException, ConnectionError) as err:
                raise _Transient(f"the connection to {host} dropped after {size} bytes ({type(err).__name__})") \
                    from None
            finally:
                if bar is not None:
                    bar.close()
        if expected is not None and size != expected:
            raise _Transient(f"the connection closed after {size} of {expected} bytes (cut off)")
        return headers, size, digest.hexdigest()
    finally:
        f.close()


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds of a ``Retry-After`` header (its number form), capped at :data:`MAX_RETRY_AFTER`."""
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER) if value is not None else None
    except ValueError:
        return None


def _progress(total: Optional[int]):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_reference(checkpoint: str, map_location: Union[str, torch.device] = "cpu") -> object:
    """What a reference (:func:`is_reference`) holds: fetched (:func:`fetch`) and read as
    weights only, or, for storage backends, mmengine's ``CheckpointLoader.load_checkpoint``."""
    kind, where = resolve(checkpoint)
    if kind == "mmengine":
        from mmengine.runner.checkpoint import CheckpointLoader

        try:
            return CheckpointLoader.load_checkpoint(checkpoint, map_location=map_location, logger="current")
        except Exception as err:  # any backend's error, never without the reference
            raise CheckpointError(f"checkpoint {checkpoint!r}: mmengine's CheckpointLoader cannot read it "
                                  f"({type(err).__name__}: {err})") from err
    path, content = fetch(checkpoint, map_location)
    if content is not None:
        return content
    try:
        return read_file(path, map_location)
    except CheckpointError as err:
        if kind == "file":
            raise CheckpointError(f"checkpoint {checkpoint!r} (mmengine's table maps it to {path!r}): {err}") from None
        raise CheckpointError(f"checkpoint {checkpoint!r} (cached at {path}): {err}; delete the cached file to "
                              "download it again") from None

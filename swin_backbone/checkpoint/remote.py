"""Checkpoint references that are not local paths: what mmengine's ``CheckpointLoader`` accepts.

=================================== ==================================================================
``http://`` / ``https://`` URL       downloaded once with torch's ``torch.hub.download_url_to_file``
                                     into ``torch.hub.get_dir()/checkpoints`` (``$TORCH_HOME/hub/...``,
                                     the file mmengine's and torch's ``load_url`` use), read from there
                                     afterwards with no network
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

What is fetched is read by :mod:`.files` (weights only, safetensors included) and then detected,
converted and reported like a local file. A reference without ``://`` is a local path and never
touches the network.

A download goes to a temporary file beside the cached one (torch's own ``.partial`` file inside
that) and is read as a checkpoint *before* it is renamed into the cache: a download cut off
(torch's downloader keeps a short file when the server closes early), an error page or any other
file that is not a checkpoint never reaches the cache, and the error names the URL.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import uuid
from typing import Optional, Tuple, Union
from urllib.parse import urlparse

import torch

from .base import CheckpointError

URL_PREFIXES = ("http://", "https://")
#: mmengine's name tables: prefix -> (what the names are, how to get a name's URL).
NAMED_PREFIXES = ("torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")
#: File names that many sources share (Hugging Face hub files): cached under a name with the
#: URL's hash in front, so two models' ``model.safetensors`` never meet in the cache.
GENERIC_NAMES = ("model.safetensors", "pytorch_model.bin", "model.bin", "model.pth", "model.pt", "checkpoint.pth",
                 "model_final.pth", "latest.pth")


def is_reference(checkpoint: str) -> bool:
    """``checkpoint`` names something other than a local path (it has a ``scheme://``)."""
    return "://" in checkpoint


def cache_dir() -> str:
    """Where URLs are cached: ``torch.hub.get_dir()/checkpoints`` (``$TORCH_HOME/hub/checkpoints``),
    the folder torch's and mmengine's ``load_url`` use."""
    return os.path.join(torch.hub.get_dir(), "checkpoints")


def cached_file(url: str) -> str:
    """The cache path of ``url``: its file name, as torch's ``load_state_dict_from_url`` names it
    (so a file mmengine downloaded is found, and the reverse); generic names
    (:data:`GENERIC_NAMES`) get the URL's hash in front."""
    name = os.path.basename(urlparse(url).path)
    if not name:
        raise CheckpointError(f"checkpoint {url!r}: the URL names no file (its path ends in '/'); "
                              "expected the URL of a checkpoint file")
    if name.lower() in GENERIC_NAMES:
        name = f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{name}"
    return os.path.join(cache_dir(), name)


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


def fetch(checkpoint: str, map_location: Union[str, torch.device] = "cpu", progress: Optional[bool] = None,
          ) -> Tuple[str, Optional[object]]:
    """The local file of a URL (cached, downloaded once) or of a named reference.

    Returns:
        ``(path, content)``: the local file, and what it holds where this call downloaded (and
        therefore already read) it, else ``None``.
    Raises:
        CheckpointError: unreachable host, an HTTP error, a cut-off download, a file that is not
            a checkpoint (nothing left in the cache), or a reference that is not a URL / name.
    """
    kind, where = resolve(checkpoint)
    if kind == "file":
        return where, None
    if kind != "url":
        raise CheckpointError(f"checkpoint {checkpoint!r}: read by mmengine's CheckpointLoader, not a file to fetch")
    path = cached_file(where)
    from mmengine.dist import barrier, get_dist_info

    def get() -> Optional[object]:
        return None if os.path.isfile(path) else _download(checkpoint, where, path, map_location, progress)

    # As mmengine's load_from_http: rank 0 downloads, the other ranks then read its file (or,
    # without a shared file system, download their own); every rank passes one barrier.
    rank, world = get_dist_info()
    if world == 1:
        return path, get()
    if rank == 0:
        try:
            return path, get()
        finally:
            barrier()
    barrier()
    return path, get()


def _download(checkpoint: str, url: str, path: str, map_location: Union[str, torch.device],
              progress: Optional[bool]) -> object:
    """Download ``url`` to ``path`` through a temporary file that must read as a checkpoint."""
    from mmengine.logging import print_log

    from .files import read_checkpoint

    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    staging = f"{path}.{uuid.uuid4().hex}.download"
    named = "" if checkpoint == url else f" ({url})"
    print_log(f"checkpoint {checkpoint!r}{named}: downloading to {path}", logger="current")
    try:
        try:
            torch.hub.download_url_to_file(url, staging, progress=os.isatty(0) if progress is None else progress)
        except urllib.error.HTTPError as err:
            raise CheckpointError(f"checkpoint {checkpoint!r}{named}: the server answered HTTP {err.code} "
                                  f"{err.reason}; expected the checkpoint file") from None
        except urllib.error.URLError as err:
            host = urlparse(url).netloc
            raise CheckpointError(f"checkpoint {checkpoint!r}{named}: cannot reach {host} ({err.reason}); "
                                  "download the file elsewhere and pass its local path, or put it at "
                                  f"{path}") from err
        except (OSError, http.client.HTTPException) as err:
            raise CheckpointError(f"checkpoint {checkpoint!r}{named}: the download failed part way "
                                  f"({type(err).__name__}: {err}); nothing was kept in the cache") from err
        size = os.path.getsize(staging)
        try:
            content = read_checkpoint(staging, map_location)
        except CheckpointError as err:
            detail = str(err)
            detail = detail.split(": ", 1)[1] if detail.startswith(f"checkpoint {staging!r}: ") else detail
            raise CheckpointError(
                f"checkpoint {checkpoint!r}{named}: the downloaded file ({size} bytes) is not a readable checkpoint: "
                f"{detail}; the download was cut off or the URL does not serve a checkpoint file (nothing was "
                "kept in the cache)") from None
        os.replace(staging, path)
        return content
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def read_reference(checkpoint: str, map_location: Union[str, torch.device] = "cpu") -> object:
    """What a reference (:func:`is_reference`) holds: fetched (:func:`fetch`) and read as
    weights only, or, for storage backends, mmengine's ``CheckpointLoader.load_checkpoint``."""
    from .files import read_checkpoint

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
        return read_checkpoint(path, map_location)
    except CheckpointError as err:
        if kind == "file":
            raise CheckpointError(f"checkpoint {checkpoint!r} (mmengine's table maps it to {path!r}): {err}") from None
        raise CheckpointError(f"checkpoint {checkpoint!r} (cached at {path}): {err}; delete the cached file to "
                              "download it again") from None

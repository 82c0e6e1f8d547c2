"""The published Swin architectures by name, V1 and V2: one table for the backbones, the
feature extractor and the tools.

A name resolves to ``embed_dims`` / ``depths`` / ``num_heads`` (V2: and
``extra_norm_every_n_blocks``); explicit values override the preset. A published Swin V2
model name (official / timm) also gives its window and pre-training windows.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..validation import check_int, check_int_sequence, fail

#: Swin V1 (Liu et al. 2021, table 1).
ARCH_SETTINGS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "small": dict(embed_dims=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "base": dict(embed_dims=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    "large": dict(embed_dims=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48)),
}
ARCH_ALIASES = {"t": "tiny", "s": "small", "b": "base", "l": "large"}

#: Swin V2: the V1 sizes (Liu et al. 2022, table 1), plus huge / giant as mmpretrain defines
#: them (the paper's giant; "huge" heads are not published by the authors).
V2_ARCH_SETTINGS: Dict[str, Dict[str, Any]] = {
    **{name: dict(preset, extra_norm_every_n_blocks=0) for name, preset in ARCH_SETTINGS.items()},
    "huge": dict(embed_dims=352, depths=(2, 2, 18, 2), num_heads=(8, 16, 32, 64), extra_norm_every_n_blocks=6),
    "giant": dict(embed_dims=512, depths=(2, 2, 42, 4), num_heads=(16, 32, 64, 128), extra_norm_every_n_blocks=6),
}
V2_ARCH_ALIASES = dict(ARCH_ALIASES, h="huge", g="giant")

#: The published V2 models (official repository / timm names): preset, window and the
#: pre-training windows. A stage whose map at the pre-training size is smaller than the window
#: was trained with the window shrunk to the map (Swin V2's small-map rule), which normalises
#: its position-bias coordinates by that smaller window: e.g. ``window16_256``'s stage 4 (map 8)
#: has pre-training window 8, ``window12_192``'s (map 6) 6, as the official fine-tunes record
#: for their stage 4 (``(12, 12, 12, 6)``).
PUBLISHED_V2: Dict[str, Dict[str, Any]] = {
    "swinv2_tiny_window8_256": dict(arch="tiny", window_size=8),
    "swinv2_tiny_window16_256": dict(arch="tiny", window_size=16, pretrained_window_sizes=(16, 16, 16, 8)),
    "swinv2_small_window8_256": dict(arch="small", window_size=8),
    "swinv2_small_window16_256": dict(arch="small", window_size=16, pretrained_window_sizes=(16, 16, 16, 8)),
    "swinv2_base_window8_256": dict(arch="base", window_size=8),
    "swinv2_base_window16_256": dict(arch="base", window_size=16, pretrained_window_sizes=(16, 16, 16, 8)),
    "swinv2_base_window12_192": dict(arch="base", window_size=12, pretrained_window_sizes=(12, 12, 12, 6)),
    "swinv2_base_window12to16_192to256": dict(arch="base", window_size=16, pretrained_window_sizes=(12, 12, 12, 6)),
    "swinv2_base_window12to24_192to384": dict(arch="base", window_size=24, pretrained_window_sizes=(12, 12, 12, 6)),
    "swinv2_large_window12_192": dict(arch="large", window_size=12, pretrained_window_sizes=(12, 12, 12, 6)),
    "swinv2_large_window12to16_192to256": dict(arch="large", window_size=16, pretrained_window_sizes=(12, 12, 12, 6)),
    "swinv2_large_window12to24_192to384": dict(arch="large", window_size=24, pretrained_window_sizes=(12, 12, 12, 6)),
}

#: The window of a preset unless one is given (the published models').
DEFAULT_WINDOW = {1: 7, 2: 8}

#: Prefix of the Swin V2 presets among the feature extractor's names: ``v2-tiny`` ...
V2_PREFIX = "v2-"


def resolve_arch(arch: Optional[str], version: int, **explicit: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(architecture, published defaults)`` of a Swin ``version`` (1 or 2) preset name.

    ``explicit`` (``embed_dims``, ``depths``, ``num_heads``; V2: ``extra_norm_every_n_blocks``)
    overrides the preset where not ``None``; ``arch=None`` needs the first three. The
    published defaults are a published V2 name's ``window_size`` / ``pretrained_window_sizes``.
    Sizes are checked, not converted (``int('abc')`` fails cryptically, ``int(33.9)`` truncates).
    """
    table, aliases = (ARCH_SETTINGS, ARCH_ALIASES) if version == 1 else (V2_ARCH_SETTINGS, V2_ARCH_ALIASES)
    published: Dict[str, Any] = {}
    preset: Dict[str, Any] = {}
    if arch is not None:
        key = arch.lower() if isinstance(arch, str) else arch
        if version == 2 and isinstance(key, str) and key in PUBLISHED_V2:
            published = dict(PUBLISHED_V2[key])
            key = published.pop("arch")
        key = aliases.get(key, key) if isinstance(key, str) else key
        if not isinstance(key, str) or key not in table:
            names = "" if version == 1 else f", or a published model name ({', '.join(sorted(PUBLISHED_V2))})"
            fail("arch", f"one of {sorted(table)} (or {sorted(aliases)}){names}", arch)
        preset = dict(table[key])
    values = dict(preset, **{k: v for k, v in explicit.items() if v is not None})
    missing = [k for k in ("embed_dims", "depths", "num_heads") if k not in values]
    if missing:
        raise ValueError(f"arch=None needs explicit {', '.join(missing)}")
    values["embed_dims"] = check_int("embed_dims", values["embed_dims"], minimum=1)
    for name in ("depths", "num_heads"):
        values[name] = check_int_sequence(name, values[name], "a list or tuple of ints >= 1, one per stage")
    return values, published


def split_arch(arch: Optional[str]) -> Tuple[int, Optional[str]]:
    """``(Swin version, the backbone's own arch name)`` of a feature-extractor name.

    ``'tiny'`` ... ``'large'`` (or ``'t'`` ...; or ``None`` with explicit sizes): Swin V1.
    ``'v2-tiny'`` ... ``'v2-giant'`` (or ``'v2-t'`` ...), or a published Swin V2 name such as
    ``'swinv2_tiny_window8_256'``: Swin V2. Case does not matter; unknown names are left
    for the backbone to refuse.
    """
    if isinstance(arch, str):
        name = arch.lower()
        if name.startswith(V2_PREFIX):
            return 2, name[len(V2_PREFIX):]
        if name in PUBLISHED_V2:
            return 2, name
    return 1, arch


def default_window_size(arch: Optional[str]) -> int:
    """The window a feature-extractor name runs with unless one is given: 7 for Swin V1, 8
    for a V2 preset, a published V2 model's own (e.g. 16 for ``swinv2_tiny_window16_256``)."""
    version, name = split_arch(arch)
    return PUBLISHED_V2.get(name, {}).get("window_size", DEFAULT_WINDOW[version])


def arch_names() -> str:
    """Every name the feature extractor takes, for help texts."""
    return (f"Swin V1: {', '.join(ARCH_SETTINGS)} (window {DEFAULT_WINDOW[1]}); Swin V2: "
            f"{', '.join(V2_PREFIX + a for a in V2_ARCH_SETTINGS)} (window {DEFAULT_WINDOW[2]}), or a published "
            f"V2 model (its window and pre-training windows): {', '.join(PUBLISHED_V2)}")

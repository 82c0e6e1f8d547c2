#!/usr/bin/env bash
# Create .venv (Python 3.11) with the whole OpenMMLab stack, idempotently.
#
# The recipe is the tested one from shared/ENVIRONMENT.md. The only slow step is compiling
# mmcv 2.1.0 with its CPU ops (~14 min on 2 cores): the built wheel is kept in a cache
# OUTSIDE the checkout, keyed by mmcv / torch / Python versions, so later setups on the same
# machine (fresh clones included) reuse it. A stamp file in .venv records the hash of this
# script and setup.cfg: when neither changed, the script exits in well under a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-$ROOT/.venv}"
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
MMENGINE_VERSION=0.10.7
MMCV_VERSION=2.1.0
MMDET_VERSION=3.3.0
MMSEG_VERSION=1.2.2
TIMM_VERSION=1.0.29
CACHE_ROOT="${SWIN_BACKBONE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swin-backbone}"
PYTAG=cp311
WHEEL_CACHE="$CACHE_ROOT/wheels/mmcv-$MMCV_VERSION-torch$TORCH_VERSION-$PYTAG"

STAMP="$VENV/.swin-backbone-setup"
want_stamp="$(cat "$ROOT/tools/setup_env.sh" "$ROOT/setup.cfg" 2>/dev/null | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

log() { printf '[setup] %s\n' "$*"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip -q still warns about every configured local index that lacks a package: drop those lines.
pip_q() { "${PIP[@]}" "$@" -q 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
have() { "$VENV/bin/python" - "$@" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split('==')
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
}

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c 'import sys, setuptools, wheel, ninja; sys.exit(int(setuptools.__version__.split(".")[0]) >= 81)' 2>/dev/null; then
    log "installing build tools (setuptools<81: mmcv's build and mmengine's mmdet::/mmseg:: lookup use pkg_resources)"
    pip_q install -U pip wheel 'setuptools<81' ninja
fi

if ! have "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"; then
    log "installing torch $TORCH_VERSION + torchvision $TORCHVISION_VERSION"
    pip_q install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

if ! have "mmengine==$MMENGINE_VERSION"; then
    pip_q install "mmengine==$MMENGINE_VERSION"
fi

if ! have "mmcv==$MMCV_VERSION"; then
    wheel="$(ls "$WHEEL_CACHE"/mmcv-$MMCV_VERSION-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$wheel" ]]; then
        log "building mmcv $MMCV_VERSION with CPU ops (about 14 minutes on 2 cores; cached in $WHEEL_CACHE)"
        work="$(mktemp -d)"
        trap 'rm -rf "$work"' EXIT
        pip_q download --no-deps --no-binary :all: --no-build-isolation \
            "mmcv==$MMCV_VERSION" -d "$work/sdist"
        mkdir -p "$work/build"
        tar xzf "$work/sdist/mmcv-$MMCV_VERSION.tar.gz" -C "$work/build"
        # torch 2.14's headers need C++20; mmcv hard-codes -std=c++17 after CFLAGS.
        sed -i 's/-std=c++17/-std=c++20/g' "$work/build/mmcv-$MMCV_VERSION/setup.py"
        MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS="${MAX_JOBS:-2}" \
            pip_q wheel --no-build-isolation --no-deps -w "$work/wheels" \
            "$work/build/mmcv-$MMCV_VERSION"
        mkdir -p "$WHEEL_CACHE"
        # Move into place atomically so a killed build never leaves a half wheel in the cache.
        for f in "$work"/wheels/mmcv-*.whl; do
            cp "$f" "$WHEEL_CACHE/.$(basename "$f").tmp"
            mv "$WHEEL_CACHE/.$(basename "$f").tmp" "$WHEEL_CACHE/$(basename "$f")"
        done
        wheel="$(ls "$WHEEL_CACHE"/mmcv-$MMCV_VERSION-*.whl | head -n1)"
    fi
    log "installing $wheel"
    pip_q install --no-deps "$wheel"
    # mmcv's own runtime requirements (no-deps above keeps pip from touching torch).
    pip_q install addict numpy packaging Pillow pyyaml yapf opencv-python
fi

log "installing mmdet, mmseg and swin_backbone (editable) with its [mmdet,mmseg,onnx,test] extras"
# Through the package's extras, so the suite runs on exactly what setup.cfg promises; the pins keep
# pip from moving torch / torchvision / mmcv. setuptools' editable build is chatty (license /
# editable-mode notices): pip's output is shown only on failure.
if ! "${PIP[@]}" install -q --no-build-isolation "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
        "mmengine==$MMENGINE_VERSION" "mmcv==$MMCV_VERSION" "mmdet==$MMDET_VERSION" \
        "mmsegmentation==$MMSEG_VERSION" "timm==$TIMM_VERSION" \
        -e "$ROOT[mmdet,mmseg,onnx,test]" >"$VENV/.editable-install.log" 2>&1; then
    cat "$VENV/.editable-install.log"; exit 1
fi

"$VENV/bin/python" -c 'import mmcv.ops, mmdet, mmseg, swin_backbone' \
    || { log "import check failed"; exit 1; }
echo "$want_stamp" > "$STAMP"
log "done: $VENV"

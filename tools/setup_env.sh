#!/usr/bin/env bash
# Create one of the project's venvs (Python 3.11), idempotently:
#
#   tools/setup_env.sh            .venv            torch 2.14.1, mmcv-lite 2.1.0 (no compile: swin_backbone.mmcv_lite
#                                                  gives it mmcv's ops from torchvision / torch), mmdet 3.3, mmseg 1.2
#   tools/setup_env.sh torch2.1   .venv-torch2.1   torch 2.1.2 + numpy 1.x, mmcv 2.1.0 built for it, mmdet 3.3, mmseg 1.2
#                                                  (the environment most mmdet / mmseg users have)
#   tools/setup_env.sh torch2.0   .venv-torch2.0   torch 2.0.1 + numpy 1.x (the supported floor), mmengine, no mmcv
#
# The recipe is the tested one from shared/ENVIRONMENT.md. The only slow step is compiling
# mmcv 2.1.0 with its CPU ops for the torch 2.1 stack (~14 min on 2 cores): the built wheel is kept in a
# cache OUTSIDE the checkout, keyed by mmcv / torch / Python versions, so later setups on the same
# machine (fresh clones included) reuse it. A stamp file in the venv records the hash of this
# script, setup.cfg and the stack name: when none changed, the script exits in well under a second.
# The old stacks install the package's extras with torch (and torchvision, mmcv, numpy) pinned to
# what is already there: the same `pip install` a user runs into an existing environment.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

STACK="${1:-main}"
PYTHON="${PYTHON:-python3.11}"
MMENGINE_VERSION=0.10.7
MMCV_VERSION=2.1.0
MMDET_VERSION=3.3.0
MMSEG_VERSION=1.2.2
TIMM_VERSION=1.0.29
case "$STACK" in
    main)
        VENV="${VENV:-$ROOT/.venv}"
        TORCH_VERSION=2.14.1; TORCHVISION_VERSION=0.29.1
        NUMPY_SPEC=""            # numpy 2.x
        WITH_MMCV=lite           # mmcv-lite: pure Python, nothing compiled (docs/mmcv-lite.md)
        CXX_STD=""
        EXTRAS="mmdet-lite,mmseg-lite,onnx,test,hf"
        ;;
    torch2.1)
        VENV="${VENV:-$ROOT/.venv-torch2.1}"
        TORCH_VERSION=2.1.2; TORCHVISION_VERSION=0.16.2
        NUMPY_SPEC="numpy<2"     # torch 2.1's wheels are built against numpy 1.x
        WITH_MMCV=1
        CXX_STD=""               # mmcv's own -std=c++17
        EXTRAS="mmdet,mmseg,test"
        ;;
    torch2.0)
        VENV="${VENV:-$ROOT/.venv-torch2.0}"
        TORCH_VERSION=2.0.1; TORCHVISION_VERSION=0.15.2
        NUMPY_SPEC="numpy<2"
        WITH_MMCV=0              # a second mmcv build (~14 min) would buy no test the torch 2.1 stack lacks
        CXX_STD=""
        EXTRAS="test"
        ;;
    *)
        echo "usage: $0 [main|torch2.1|torch2.0]" >&2; exit 2 ;;
esac
CACHE_ROOT="${SWIN_BACKBONE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/swin-backbone}"
PYTAG=cp311
WHEEL_CACHE="$CACHE_ROOT/wheels/mmcv-$MMCV_VERSION-torch$TORCH_VERSION-$PYTAG"

STAMP="$VENV/.swin-backbone-setup"
want_stamp="$( (echo "$STACK"; cat "$ROOT/tools/setup_env.sh" "$ROOT/setup.cfg") 2>/dev/null | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

log() { printf '[setup %s] %s\n' "$STACK" "$*"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip -q still warns about every configured local index that lacks a package: drop those lines.
pip_q() { "${PIP[@]}" "$@" -q 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
have() { "$VENV/bin/python" - "$@" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split('==')
    try:
        if version(name).split('+')[0] != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
}
started=$SECONDS

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c 'import sys, setuptools, wheel, ninja; sys.exit(int(setuptools.__version__.split(".")[0]) >= 81)' 2>/dev/null; then
    log "installing build tools (setuptools<81: mmcv's build and mmengine's mmdet::/mmseg:: lookup use pkg_resources)"
    pip_q install -U pip wheel 'setuptools<81' ninja
fi

# The packages pinned for the whole setup: pip never moves them afterwards.
PINS=("torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION")
[[ -n "$NUMPY_SPEC" ]] && PINS+=("$NUMPY_SPEC")

if ! have "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"; then
    log "installing torch $TORCH_VERSION + torchvision $TORCHVISION_VERSION ${NUMPY_SPEC}"
    pip_q install "${PINS[@]}"
fi

if ! have "mmengine==$MMENGINE_VERSION"; then
    pip_q install "mmengine==$MMENGINE_VERSION" "${PINS[@]}"
fi

if [[ "$WITH_MMCV" == lite ]] && ! have "mmcv-lite==$MMCV_VERSION"; then
    log "installing mmcv-lite $MMCV_VERSION (no compiled ops: swin_backbone.mmcv_lite provides them)"
    pip_q install "mmcv-lite==$MMCV_VERSION" "${PINS[@]}"
fi

if [[ "$WITH_MMCV" == 1 ]] && ! have "mmcv==$MMCV_VERSION"; then
    wheel="$(ls "$WHEEL_CACHE"/mmcv-$MMCV_VERSION-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$wheel" ]]; then
        log "building mmcv $MMCV_VERSION for torch $TORCH_VERSION with CPU ops (about 14 minutes on 2 cores; cached in $WHEEL_CACHE)"
        work="$(mktemp -d)"
        trap 'rm -rf "$work"' EXIT
        pip_q download --no-deps --no-binary :all: --no-build-isolation \
            "mmcv==$MMCV_VERSION" -d "$work/sdist"
        mkdir -p "$work/build"
        tar xzf "$work/sdist/mmcv-$MMCV_VERSION.tar.gz" -C "$work/build"
        if [[ -n "$CXX_STD" ]]; then
            # mmcv hard-codes -std=c++17 after CFLAGS: newer torch headers need a newer standard.
            sed -i "s/-std=c++17/-std=c++$CXX_STD/g" "$work/build/mmcv-$MMCV_VERSION/setup.py"
        fi
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
    pip_q install addict packaging Pillow pyyaml yapf opencv-python "${PINS[@]}"
fi

PKGS=("${PINS[@]}" "mmengine==$MMENGINE_VERSION" "timm==$TIMM_VERSION")
if [[ "$WITH_MMCV" == 1 ]]; then
    PKGS+=("mmcv==$MMCV_VERSION" "mmdet==$MMDET_VERSION" "mmsegmentation==$MMSEG_VERSION")
elif [[ "$WITH_MMCV" == lite ]]; then
    PKGS+=("mmcv-lite==$MMCV_VERSION" "mmdet==$MMDET_VERSION" "mmsegmentation==$MMSEG_VERSION")
fi
log "installing swin_backbone (editable) with its [$EXTRAS] extras"
# Through the package's extras, so the suite runs on exactly what setup.cfg promises; the pins keep
# pip from moving torch / torchvision / numpy / mmcv. setuptools' editable build is chatty
# (license / editable-mode notices): pip's output is shown only on failure.
if ! "${PIP[@]}" install -q --no-build-isolation "${PKGS[@]}" \
        -e "$ROOT[$EXTRAS]" >"$VENV/.editable-install.log" 2>&1; then
    cat "$VENV/.editable-install.log"; exit 1
fi

check='import torch, swin_backbone; assert torch.__version__.split("+")[0] == "'"$TORCH_VERSION"'", torch.__version__'
[[ "$WITH_MMCV" == 1 ]] && check="import mmcv.ops, mmdet, mmseg; $check; from swin_backbone import mmcv_lite; assert not mmcv_lite.active()"
# swin_backbone first: it gives mmcv-lite its ops before mmdet / mmseg import mmcv.ops.
[[ "$WITH_MMCV" == lite ]] && check="$check; import mmdet.models, mmseg.models; from swin_backbone import mmcv_lite; assert mmcv_lite.active()"
"$VENV/bin/python" -c "$check" || { log "import check failed"; exit 1; }
echo "$want_stamp" > "$STAMP"
log "done: $VENV ($((SECONDS - started)) s)"

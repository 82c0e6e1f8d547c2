import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=["kept-probs", "recomputed-probs"])
def attention_probs(request):
    """Runs a test twice: CPU training attention keeping its probabilities in every layer, and
    recomputing them in backward in every layer (at test sizes all layers would keep them)."""
    from swin_backbone import ops

    with ops.override(keep_probs_bytes=2**40 if request.param == "kept-probs" else 0):
        yield request.param


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device this machine has (CPU always; CUDA where available, with TF32 off so that
    fp32 parity holds to 1e-4: cuDNN convolutions default to TF32)."""
    if request.param == "cuda":
        old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    else:
        yield torch.device("cpu")


def small_arch(**kw):
    """A fast Swin config for tests: real structure, fewer channels and blocks."""
    cfg = dict(arch=None, embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16), drop_path_rate=0.0)
    cfg.update(kw)
    return cfg

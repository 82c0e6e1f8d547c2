import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


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

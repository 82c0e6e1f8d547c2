"""``BF16AutocastOptimWrapper``: the optimizer wrapper configs name for bf16 mixed precision
(``optim_wrapper=dict(type='BF16AutocastOptimWrapper')``; tools/train.py ``--amp`` on the CPU)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS


@OPTIM_WRAPPERS.register_module(force=True)
class BF16AutocastOptimWrapper(OptimWrapper):
    """``OptimWrapper`` that runs forward passes under bf16 autocast on the model's device.

    mmengine's ``AmpOptimWrapper`` is CUDA-only and fp16 (with loss scaling); bf16 has
    fp32's range, so no loss scaler is needed and it works on CPU.
    """

    @contextmanager
    def optim_context(self, model: torch.nn.Module):
        device = next(model.parameters()).device.type
        with super().optim_context(model), torch.autocast(device_type=device, dtype=torch.bfloat16):
            yield

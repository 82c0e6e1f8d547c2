"""Reading a Swin-L checkpoint: the package's inert unpickler against torch's own weights-only
torch.load of the same file, and the whole load_checkpoint into a model. Interleaved rounds,
medians. Usage: python load_speed.py [rounds] (writes a Swin-L state dict to a temp folder)."""
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from swin_backbone import SwinBackbone, load_checkpoint
try:
    from swin_backbone.checkpoint import read_checkpoint
except ImportError:  # (a checkout before read_checkpoint)
    read_checkpoint = None


def main(rounds: int = 7) -> None:
    torch.manual_seed(0)
    model = SwinBackbone("large", window_size=12)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "swin_large.pth")
        torch.save({"state_dict": model.state_dict(), "meta": {"epoch": 1}}, path)
        size = os.path.getsize(path)
        times = {"torch.load(weights_only=True)": [], "read_checkpoint (inert unpickler)": [],
                 "torch.load + model.load_state_dict": [], "load_checkpoint into the model": []}
        for _ in range(rounds):
            for name in times:
                start = time.perf_counter()
                if name == "torch.load + model.load_state_dict":
                    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
                elif name.startswith("torch"):
                    torch.load(path, map_location="cpu", weights_only=True)
                elif name.startswith("read"):
                    read_checkpoint(path)
                else:
                    load_checkpoint(model, path, logger=None)
                times[name].append(time.perf_counter() - start)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps(dict(machine=f"{platform.node()} {cpu}, {os.cpu_count()} cores", torch=torch.__version__,
                          file_mb=round(size / 2 ** 20, 1), rounds=rounds,
                          median_s={k: round(v, 4) for k, v in med.items()},
                          ratio_read_vs_torch=round(med["read_checkpoint (inert unpickler)"]
                                                    / med["torch.load(weights_only=True)"], 3),
                          ratio_load_checkpoint_vs_torch_load_state_dict=round(
                              med["load_checkpoint into the model"] / med["torch.load + model.load_state_dict"], 3),
                          all_s={k: [round(x, 4) for x in v] for k, v in times.items()}), indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)

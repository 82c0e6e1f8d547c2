"""Where CPU eval time goes (1x3x800x1216, fp32 and bf16 autocast): GEMM self time and FLOPs per model."""
import json, sys, time, statistics, torch
from torch.profiler import profile
from swin_backbone.tools import benchmarking as B
models = B.build_pair("cpu")
x = torch.randn(1, 3, 800, 1216)
out = {}
a = torch.randn(2048, 2048); b = torch.randn(2048, 2048)
for _ in range(3): a @ b
ts = []
for _ in range(10):
    t0 = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t0)
out["mm2048_gflops"] = 2 * 2048**3 / statistics.median(ts) / 1e9
for dt in (None, torch.bfloat16):
    for k, m in models.items():
        m.eval(); f = B.eval_step(m, x, dt)
        f(); f()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
        with profile(with_flops=True) as p:
            f()
        ev = p.key_averages()
        gemm = [e for e in ev if e.key in ("aten::addmm", "aten::mm")]
        g_ms = sum(e.self_cpu_time_total for e in gemm) / 1e3
        g_fl = sum(e.flops for e in gemm)
        tot = sum(e.self_cpu_time_total for e in ev) / 1e3
        top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:8]
        tag = f"{k}_{'bf16' if dt else 'fp32'}"
        out[tag] = dict(times_ms=[round(t * 1e3) for t in ts], profiled_ms=round(tot), gemm_ms=round(g_ms),
                        gemm_gflop=round(g_fl / 1e9, 1), gemm_gflops=round(g_fl / g_ms / 1e6, 1),
                        top={e.key: round(e.self_cpu_time_total / 1e3, 1) for e in top})
        print(tag, json.dumps(out[tag]), flush=True)
print("mm2048", round(out["mm2048_gflops"], 1))
json.dump(out, open(sys.argv[1], "w"), indent=1)

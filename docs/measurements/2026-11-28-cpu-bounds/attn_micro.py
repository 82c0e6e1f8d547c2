import time, torch, torch.nn.functional as F
torch.manual_seed(0)
def bench(f, n=10):
    f(); f()
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e3
for (nw, nh) in ((1276, 3), (330, 6), (88, 12), (24, 24)):
  for dt in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(nw, nh, 49, 32, dtype=dt) for _ in range(3))
    bias = torch.randn(1, nh, 49, 49, dtype=dt)
    mask = torch.randn(nw, nh, 49, 49, dtype=dt)
    s = 32 ** -0.5
    sd = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=s))
    sdm = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s))
    def plain(m):
        a = (q @ k.transpose(-2, -1)).mul_(s).add_(m)
        return a.softmax(-1) @ v
    pl = bench(lambda: plain(bias))
    plm = bench(lambda: plain(mask))
    flops = nw * nh * 49 * 49 * 32 * 4
    print(f"{nw}x{nh} {str(dt)[6:]}: sdpa {sd:.2f} ms ({flops/sd/1e6:.0f} GF/s), sdpa+mask {sdm:.2f}, plain {pl:.2f}, plain+mask {plm:.2f}")

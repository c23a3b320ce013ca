"""The "highest" training step's per-position GEMMs on the tensor cores, probed: each GEMM the step runs today
as cuBLAS fp32 (CUDA cores, ~46 TFLOP/s: 13.4 of the 28.0 ms at (1,1024,128,128), 52 of 78 at
(1,1024,384,128)) timed and checked against fp64 as cuBLAS fp32 and as our contraction kernels run it:
`mma` at "highest" (3xTF32 on mma.sync, fp32-accurate) and `wgmma_tma` on split operands (contract_split:
3xTF32 on wgmma; timed with the split's elementwise ops, and for the products alone). Weight gradients (K =
positions) too: their tensor-core accumulation over ~10^6 terms failed 1e-5 before (NOTES, branch
highest-tf32x3); with --k-chunk the K axis is cut into chunks whose fp32 results are summed in order, as a
split-K kernel would.

    python dev/highest_gemm_probe.py [--shape 1,1024,384,128] [--k-chunk 0] [--calls 5]

Operands are random with the step's scales (LayerNorm-ed rows ~1, weights ~1/sqrt(fan-in)); each result's error
is ||z - z64|| / ||z64|| over the first 4096 rows (all rows for the weight gradients).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402


def median_ms(fn, calls: int) -> float:
    """bench.py's timing (warm-up, CUDA events, median) in ms, at least `calls` timed calls."""
    return bench.time_cuda(fn, min_reps=calls, budget_s=0.0)[0] / 1e3


def chunked(fn, a, b, z, k_chunk):
    """z = a b^T with K cut into k_chunk pieces, each piece's product added to z in order (fp32)."""
    if k_chunk <= 0 or k_chunk >= a.shape[2]:
        return fn(z, a, b)
    part = torch.empty_like(z)
    z.zero_()
    for start in range(0, a.shape[2], k_chunk):
        fn(part, a[:, :, start:start + k_chunk].contiguous(), b[:, :, start:start + k_chunk].contiguous())
        z.add_(part)
    return z


def split_wgmma(out, x, y):
    """3xTF32 on wgmma_tma from operands split here (the split's elementwise ops included in the time)."""
    ti._extension().contract_split("wgmma_tma", ti._tf32_split(x), ti._tf32_split(y), out,
                                   ti._PRECISION_CODE["highest"])


def probe(name, a, b, calls, k_chunk, rows=4096):
    """One GEMM z = a[0] b[0]^T by each route: time, TFLOP/s and error against fp64."""
    z = torch.empty(1, a.shape[1], b.shape[1], device="cuda")
    flop = 2.0 * a.shape[1] * b.shape[1] * a.shape[2]
    reference = a[0, :rows].double() @ b[0].double().t()
    a_split, b_split = ti._tf32_split(a), ti._tf32_split(b)
    routes = {
        "cuBLAS fp32": lambda out, x, y: torch.bmm(x, y.transpose(1, 2), out=out),
        "mma highest (3xTF32)": lambda out, x, y: ti.contract_into(out, x, y, "mma", "highest"),
        "wgmma_tma split, with split": split_wgmma,
    }
    if k_chunk <= 0:  # (the split made once: the products alone)
        routes["wgmma_tma split, products"] = lambda out, x, y: ti._extension().contract_split(
            "wgmma_tma", a_split, b_split, out, ti._PRECISION_CODE["highest"])
    for route, fn in routes.items():
        try:
            with ti._float32_matmul_precision("highest"):
                ms = median_ms(lambda: chunked(fn, a, b, z, k_chunk), calls)
                error = ((z[0, :rows].double() - reference).norm() / reference.norm()).item()
        except (ValueError, RuntimeError) as e:
            print(f"  {name:34s} {route:26s} n/a: {str(e).splitlines()[0][:90]}")
            continue
        print(f"  {name:34s} {route:26s} {ms:8.2f} ms {flop / ms / 1e9:6.0f} TFLOP/s  error {error:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,1024,384,128")
    parser.add_argument("--k-chunk", type=int, default=0, help="weight gradients' K chunk (0: whole)")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    batch, n, c, h = (int(x) for x in args.shape.split(","))
    p = batch * n * n
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = lambda cols: torch.randn(1, p, cols, device="cuda", generator=g)  # noqa: E731
    weight = lambda out, fan_in: torch.randn(1, out, fan_in, device="cuda", generator=g) / fan_in ** 0.5  # noqa: E731
    print(f"({args.shape}) highest: the step's per-position GEMMs, P = {p}")
    x_hat, z_hat = rows(c), rows(h)
    probe("proj = x_hat W_in^T", x_hat, weight(4 * h, c), args.calls, 0)
    probe("gate_pre = x_hat W_g^T", x_hat, weight(c, c), args.calls, 0)
    probe("o = z_hat W_out^T", z_hat, weight(c, h), args.calls, 0)
    d_rows = rows(4 * h + c) * 1e-3
    probe("d x_hat = [d proj | d gate] [W_in; W_g]", d_rows, weight(c, 4 * h + c), args.calls, 0)
    del d_rows
    d_o = rows(c) * 1e-3
    probe("d z_hat = d o W_out", d_o, weight(h, c), args.calls, 0)
    # Weight gradients: K = positions; operands transposed once here (not timed).
    d_proj_t = (rows(4 * h) * 1e-3).transpose(1, 2).contiguous()
    x_hat_t = x_hat.transpose(1, 2).contiguous()
    del x_hat, z_hat
    probe(f"g_in = d proj^T x_hat (K chunk {args.k_chunk})", d_proj_t, x_hat_t, args.calls, args.k_chunk,
          rows=4 * h)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    d_proj_t.transpose(1, 2).contiguous()
    end.record()
    torch.cuda.synchronize()
    print(f"  (one transpose of d proj [P, 4H] fp32: {start.elapsed_time(end):.2f} ms)")


if __name__ == "__main__":
    main()

"""The position_gemm role's wgmma_tf32x3 (kernels/position_gemm_wgmma_tf32x3.cu) against cuBLAS fp32: the
"highest" training step's GEMMs over positions (out[P, N] = rows[P, K] W[N, K]^T + bias) at P = 2^20 for
pair_dim 128 and 384 (hidden 128), time and error against fp64; then odd sizes (P, K, N not multiples of the
tiles, a row pitch wider than K, no bias, a transposed weight) for correctness.

    python dev/rows_gemm_probe.py [--calls 10] [--positions 1048576] [--kernel wgmma_tf32x3]

The kernel's unpromoted variant (the tensor cores' sums over all of K, no fp32 adds per 32-k tile) is
dev/position_gemm_unpromoted.diff: `git apply` it, rebuild, run this again. With
dev/position_gemm_weight_grads.diff applied it also times the weight gradients (position_gemm_grad).

Operands have the step's scales (LayerNorm-ed rows ~1, weights ~1/sqrt(K)); errors are ||out - out64|| / ||out64||
over the first 8192 rows.
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402

# (name, K, N) per pair_dim C, hidden H: the GEMMs the "highest" step runs over positions
GEMMS = {
    128: [("proj", 128, 512), ("gate_pre", 128, 128), ("o", 128, 128), ("d_z_hat", 128, 128), ("d_x_hat", 640, 128)],
    384: [("proj", 384, 512), ("gate_pre", 384, 384), ("o", 128, 384), ("d_z_hat", 384, 128), ("d_x_hat", 896, 384)],
}


class Product:
    """A position_gemm kernel through the extension (the weight split inside the call)."""

    def __init__(self, kernel):
        self.kernel = kernel

    @staticmethod
    def split_weight(w):
        return w

    def gemm(self, rows, w, n, bias):
        return ti._extension().position_gemm(self.kernel, rows, w, bias, ti._PRECISION_CODE["highest"])


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def check(ext, m, k, n, pitch=None, with_bias=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pitch = pitch or k
    base = torch.randn(m, pitch, device="cuda", generator=g)
    rows = base[:, :k]
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    bias = torch.randn(n, device="cuda", generator=g) if with_bias else None
    ref = rows.double() @ w.double().t() + (bias.double() if with_bias else 0)
    out = ext.gemm(rows, ext.split_weight(w), n, bias)
    cublas = torch.addmm(bias, rows, w.t()) if with_bias else rows @ w.t()
    # a transposed weight (the d x_hat GEMMs multiply by W, not W^T): split from its strides
    out_t = ext.gemm(rows, ext.split_weight(w.t().contiguous().t()), n, bias)
    return rel(out, ref), rel(cublas, ref), torch.equal(out, out_t)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--positions", type=int, default=1 << 20)
    parser.add_argument("--kernel", default="wgmma_tf32x3", help="the position_gemm kernel to time (registry name)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    ext = Product(args.kernel)
    print("odd sizes (m, k, n, pitch, bias): ours err / cuBLAS err / transposed-weight split equal")
    for m, k, n, pitch, with_bias in [(1, 4, 1, None, True), (7, 12, 9, None, True), (1000, 100, 72, None, False),
                                      (4097, 640, 128, 1024, True), (333, 36, 260, 40, True),
                                      (65536, 896, 384, None, True)]:
        ours, cublas, same = check(ext, m, k, n, pitch, with_bias)
        flag = "ok" if ours <= max(3 * cublas, 5e-7) and same else "FAIL"
        print(f"  {m:6d} {k:4d} {n:4d} {str(pitch):5s} {with_bias!s:5s}: {ours:.2e} / {cublas:.2e} / {same}  {flag}")
    p = args.positions
    print(f"\nP = {p}: median ms (cuBLAS fp32 -> {args.kernel}), TFLOP/s of ours, errors vs fp64 (first 8192 rows)")
    for c, gemms in GEMMS.items():
        for name, k, n in gemms:
            rows = torch.randn(p, k, device="cuda")
            w = torch.randn(n, k, device="cuda") / k ** 0.5
            bias = torch.randn(n, device="cuda")
            w_split = ext.split_weight(w)
            t_cublas = bench.time_cuda(lambda: torch.addmm(bias, rows, w.t()), min_reps=args.calls, budget_s=0.0)[0]
            t_ours = bench.time_cuda(lambda: ext.gemm(rows, w_split, n, bias), min_reps=args.calls,
                                     budget_s=0.0)[0]
            ref = rows[:8192].double() @ w.double().t() + bias.double()
            err_ours = rel(ext.gemm(rows, w_split, n, bias)[:8192], ref)
            err_cublas = rel(torch.addmm(bias, rows, w.t())[:8192], ref)
            tflops = 2.0 * p * k * n / (t_ours * 1e-6) / 1e12
            print(f"  C={c} {name:9s} K={k:4d} N={n:4d}: {t_cublas / 1e3:7.3f} -> {t_ours / 1e3:7.3f} ms "
                  f"({tflops:5.1f} TFLOP/s, the weight's split included)  err {err_cublas:.2e} -> {err_ours:.2e}")
            del rows
    if hasattr(ti._extension(), "position_gemm_grad"):  # (dev/position_gemm_weight_grads.diff applied)
        grads(args.calls, p, args.kernel)


# (name, N, K) per pair_dim C, hidden H: the weight gradients d_rows[P, N]^T rows[P, K] the "highest" step runs
GRADS = {
    128: [("g_in", 512, 128), ("g_gate", 128, 128), ("g_out", 128, 128)],
    384: [("g_in", 512, 384), ("g_gate", 384, 384), ("g_out", 384, 128)],
}


def grads(calls, p, kernel):
    """position_gemm_grad against cuBLAS fp32 at the weight gradients' shapes: time, and error against fp64 over all
    p positions (the sums are the point)."""
    print(f"\nweight gradients over P = {p}: median ms (cuBLAS fp32 -> {kernel}), TFLOP/s of ours, errors vs fp64")
    highest = ti._PRECISION_CODE["highest"]
    for c, shapes in GRADS.items():
        for name, n, k in shapes:
            d_rows = torch.randn(p, n, device="cuda") * 0.01
            rows = torch.randn(p, k, device="cuda")
            t_cublas = bench.time_cuda(lambda: d_rows.t() @ rows, min_reps=calls, budget_s=0.0)[0]
            t_ours = bench.time_cuda(lambda: ti._extension().position_gemm_grad(kernel, d_rows, rows, highest),
                                     min_reps=calls, budget_s=0.0)[0]
            ref = d_rows.double().t() @ rows.double()
            err_ours = rel(ti._extension().position_gemm_grad(kernel, d_rows, rows, highest), ref)
            err_cublas = rel(d_rows.t() @ rows, ref)
            tflops = 2.0 * p * k * n / (t_ours * 1e-6) / 1e12
            print(f"  C={c} {name:7s} N={n:4d} K={k:4d}: {t_cublas / 1e3:7.3f} -> {t_ours / 1e3:7.3f} ms "
                  f"({tflops:5.1f} TFLOP/s)  err {err_cublas:.2e} -> {err_ours:.2e}")
            del d_rows, rows, ref


if __name__ == "__main__":
    main()

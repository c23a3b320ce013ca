"""The contraction alone at large N: z = a b^T per hidden channel, bf16 planes in and out ([H, N, N]), by a
contraction kernel of ours and by cuBLAS (torch.bmm) on the same buffers; bench.py's timing (CUDA events,
median after warm-up).

    python dev/contract_large_n.py --n 4096,8192 [--hidden 128] [--kernel wgmma_tma] [--calls 5]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", default="4096,8192")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--kernel", default="wgmma_tma")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    for n in (int(x) for x in args.n.split(",")):
        a = torch.randn(args.hidden, n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(args.hidden, n, n, device="cuda", dtype=torch.bfloat16)
        z = torch.empty_like(a)
        flop = 2.0 * args.hidden * n ** 3
        ours = median_ms(lambda: ti.contract_into(z, a, b, args.kernel, "medium"), args.calls)
        check = torch.bmm(a[:2].float(), b[:2].float().transpose(1, 2))
        error = ((z[:2].float() - check).norm() / check.norm()).item()
        del check
        cublas = median_ms(lambda: torch.bmm(a, b.transpose(1, 2), out=z), args.calls)
        print(f"N={n} H={args.hidden}: {args.kernel} {ours:.1f} ms ({flop / ours / 1e9:.0f} TFLOP/s, rel. error "
              f"{error:.1e}), cuBLAS bmm {cublas:.1f} ms ({flop / cublas / 1e9:.0f} TFLOP/s)")
        del a, b, z
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

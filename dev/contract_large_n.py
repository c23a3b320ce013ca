"""The contraction alone at large N: z = a b^T per hidden channel, bf16 planes in and out ([H, N, N]), by a
contraction kernel of ours and by cuBLAS (torch.bmm) on the same buffers; bench.py's timing (CUDA events,
median after warm-up).

    python dev/contract_large_n.py --n 4096,8192 [--hidden 128] [--kernel wgmma_tma[,other...]] [--calls 5]
        [--rounds 1]

Several kernels: an A/B in one process, the kernels in turn for --rounds rounds on the same buffers (the card's
clock drifts over a run: turns spread it over every kernel).
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
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    kernels = args.kernel.split(",")
    for n in (int(x) for x in args.n.split(",")):
        a = torch.randn(args.hidden, n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(args.hidden, n, n, device="cuda", dtype=torch.bfloat16)
        z = torch.empty_like(a)
        flop = 2.0 * args.hidden * n ** 3
        check = torch.bmm(a[:2].float(), b[:2].float().transpose(1, 2))
        for round_ in range(args.rounds):
            for kernel in kernels:
                z.fill_(float("nan"))
                ours = median_ms(lambda: ti.contract_into(z, a, b, kernel, "medium"), args.calls)
                error = ((z[:2].float() - check).norm() / check.norm()).item()
                print(f"N={n} H={args.hidden} round {round_}: {kernel} {ours:.1f} ms ({flop / ours / 1e9:.0f} "
                      f"TFLOP/s, rel. error {error:.1e}, NaN {bool(z.isnan().any())})", flush=True)
        del check
        cublas = median_ms(lambda: torch.bmm(a, b.transpose(1, 2), out=z), args.calls)
        print(f"N={n} H={args.hidden}: cuBLAS bmm {cublas:.1f} ms ({flop / cublas / 1e9:.0f} TFLOP/s)", flush=True)
        del a, b, z
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Can a memory pass run beside the N = 8192 contraction for free? At N = 8192 the contraction is power-bound
(its SM clock falls to ~1.4 GHz, bench/NOTES.md "Contraction at large N"), so fewer SMs at a higher clock might
multiply as fast, and the SMs a concurrent pass takes would cost little. This probe measures it before any
pipeline is built: the contraction as cuBLAS batched GEMMs over row blocks of z (z = a b^T per plane, bf16,
[H, N, N]) on one stream, and our output pass (forward_steps at (1, pass_n, 128, 128), bf16 in/out, the gate on
the normalized input) `passes` times: alone, one after the other, and beside each other (the passes on a
high-priority stream, each after a row block, as an overlapped forward would run the output pass of the rows
the contraction has finished). Median ms of `calls` runs (CUDA events).

    python dev/overlap_power_probe.py [--n 8192] [--blocks 8] [--pass-n 4096] [--passes 4] [--calls 3]
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
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--pass-n", type=int, default=4096)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    n, hidden, blocks = args.n, args.hidden, args.blocks
    if n % blocks or blocks % args.passes:
        raise SystemExit("--n must be a multiple of --blocks, and --blocks of --passes")
    rows = n // blocks
    a = torch.randn(hidden, n, n, device="cuda", dtype=torch.bfloat16)
    b_t = torch.randn(hidden, n, n, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    z = torch.empty(blocks, hidden, rows, n, device="cuda", dtype=torch.bfloat16)  # (row block r: z[r])

    model = ti.ModelNew(128, 128, gate_input="normalized").cuda().to(torch.bfloat16)
    pair = torch.randn(1, args.pass_n, args.pass_n, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1, args.pass_n, args.pass_n, device="cuda", dtype=torch.bool)
    steps = model.forward_steps(pair, mask)
    ab, z_pass, out = steps.new_ab(), steps.new_z(), steps.new_out()
    steps.input_pass(ab)
    steps.contraction(ab, z_pass)

    def block(r):
        torch.bmm(a[:, r * rows:(r + 1) * rows], b_t, out=z[r])

    def contraction():
        for r in range(blocks):
            block(r)

    def passes():
        for _ in range(args.passes):
            steps.output_pass(out, z=z_pass, ab=ab)

    side = torch.cuda.Stream(priority=-1)  # (higher priority: its blocks take SMs as the GEMM's free them)
    every = blocks // args.passes

    def beside():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for r in range(blocks):
            block(r)
            if (r + 1) % every == 0:
                done = torch.cuda.Event()
                done.record(main)
                side.wait_event(done)
                with torch.cuda.stream(side):
                    steps.output_pass(out, z=z_pass, ab=ab)
        main.wait_stream(side)

    def all_at_once():  # (every pass queued at the start beside the whole contraction)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            passes()
        contraction()
        main.wait_stream(side)

    flop = 2.0 * hidden * n ** 3
    results = {}
    for name, fn in (("contraction", contraction), ("passes", passes),
                     ("in sequence", lambda: (contraction(), passes())), ("beside, after each block", beside),
                     ("beside, all at once", all_at_once), ("contraction again", contraction)):
        results[name] = median_ms(fn, args.calls)
        print(f"{name:26s} {results[name]:8.1f} ms", flush=True)
    print(f"contraction {flop / results['contraction'] / 1e9:.0f} TFLOP/s; passes {args.passes} x "
          f"{results['passes'] / args.passes:.2f} ms; hidden behind the contraction: "
          f"{1 - (results['beside, after each block'] - results['contraction']) / results['passes']:.0%} (after each "
          f"block), {1 - (results['beside, all at once'] - results['contraction']) / results['passes']:.0%} (all at "
          f"once)")


if __name__ == "__main__":
    main()

"""The training step at host-bound shapes with the backward's CUDA-graph limits as committed against raised ones
(trimul_inline.GRAPHED_BACKWARD_POSITIONS / _BYTES), one process, same inputs: the step's median by CUDA events
back to back (bench.py's way), the host's issue time per step, and the memory the graph pool holds.

    python dev/graph_limit_ab.py [--shapes "1,512,128,128;2,256,384,128"] [--bf16]

Where the host is slow (session 38: cudaLaunchKernel ~11 µs, the (1,512,128,128) step host-bound at ~2.4 ms against
~1.6 ms of CUDA time) a graphed backward trades host calls for three input copies, a recomputed z and x_hat, and
the pool's memory.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402

LIMITS = {"committed": (ti.GRAPHED_BACKWARD_POSITIONS, ti.GRAPHED_BACKWARD_BYTES), "raised": (1 << 20, 1 << 28)}


def timed(step, steps: int):
    """(median µs per step by CUDA events, host µs per step issuing them back to back)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    t0 = time.perf_counter()
    for begin, end in events:
        begin.record()
        step()
        end.record()
    host = (time.perf_counter() - t0) / steps * 1e6
    torch.cuda.synchronize()
    return sorted(b.elapsed_time(e) for b, e in events)[steps // 2] * 1e3, host


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1,512,128,128;2,256,384,128")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    for shape in args.shapes.split(";"):
        batch, n, pair_dim, hidden = (int(x) for x in shape.split(","))
        torch.manual_seed(0)
        model = ti.ModelNew(pair_dim, hidden, gate_input="normalized", precision="medium").cuda().to(dtype)
        pair = torch.randn(batch, n, n, pair_dim, device="cuda", dtype=dtype, requires_grad=True)
        mask = torch.rand(batch, n, n, device="cuda") > 0.1

        def step():
            model.zero_grad(set_to_none=True)
            pair.grad = None
            model(pair, mask).float().square().mean().backward()

        for name, (positions, size) in LIMITS.items():
            ti.GRAPHED_BACKWARD_POSITIONS, ti.GRAPHED_BACKWARD_BYTES = positions, size
            graphed = ti._graphs_backward(pair, "bf16" if args.bf16 else "medium")
            before = torch.cuda.memory_allocated()
            median, host = timed(step, args.steps)
            held = (torch.cuda.memory_allocated() - before) / 2**20
            print(f"{shape} {dtype} limits {name:9s} (graphed {graphed}): step {median:7.0f} us, host issue "
                  f"{host:7.0f} us per step, held {held:6.0f} MiB", flush=True)
        ti.GRAPHED_BACKWARD_POSITIONS, ti.GRAPHED_BACKWARD_BYTES = LIMITS["committed"]


if __name__ == "__main__":
    main()

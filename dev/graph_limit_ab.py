"""The training step at host-bound shapes with the backward's CUDA-graph limits as committed against raised ones
(trimul_inline.GRAPHED_BACKWARD_POSITIONS / _BYTES), one process, same inputs: the step's median by CUDA events
back to back (bench.py's way), the host's issue time per step, and the memory a graph pool then holds (bench.py's
held memory).

    python dev/graph_limit_ab.py [--shapes "1,512,128,128;2,256,384,128"] [--bf16]

Where the host is slow (session 38: cudaLaunchKernel ~11 µs, the (1,512,128,128) step host-bound at ~2.4 ms against
~1.6 ms of CUDA time) a graphed backward trades host calls for three input copies, a recomputed z and x_hat, and
the pool's memory.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402
from dev.backward_profile import back_to_back  # noqa: E402

CASE = argparse.Namespace(direction="outgoing", gate_input="normalized")  # (bench.seeded_case's)
LIMITS = {"committed": (ti.GRAPHED_BACKWARD_POSITIONS, ti.GRAPHED_BACKWARD_BYTES), "raised": (1 << 20, 1 << 28)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=bench.parse_shapes, default=bench.parse_shapes("1,512,128,128;2,256,384,128"))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    for shape in args.shapes:
        ref, pair, mask = bench.seeded_case(shape, CASE, 0)
        trainable = bench.trainable_module(bench.make_model_new(ref, precision="medium").to(dtype))
        leaf = pair.to(dtype).requires_grad_(True)
        step = bench.training_step(trainable, leaf, mask)
        for name, (positions, size) in LIMITS.items():
            ti.GRAPHED_BACKWARD_POSITIONS, ti.GRAPHED_BACKWARD_BYTES = positions, size
            graphed = ti._graphs_backward(leaf, "bf16")
            before = bench.held_memory_start()
            bench.warm_up(step)
            median, issue, _ = back_to_back(step, args.steps)
            bench.clear_gradients(trainable, leaf)
            print(f"{shape} {dtype} limits {name:9s} (graphed {graphed}): step {median:7.0f} us, host issue "
                  f"{issue:7.0f} us per step, held {bench.held_memory_mib(before):6.0f} MiB", flush=True)


if __name__ == "__main__":
    main()

"""What a compiled (torch.compile, default inductor) training step should keep for its backward: time and peak of
the step as bench.py --backward runs it, with the op trimul keeping z, the a/b planes, x_hat and its rstd (what it
keeps now), z and the a/b planes (x_hat recomputed), z alone (the others recomputed), or nothing (backward_saves="inputs"), beside the eager step. The
compiled backward holds every kept buffer until trimul_backward returns (the eager one frees each after its last
use), so keeping all of them raised the compiled peak ~1.3 GiB over the eager step's at (1,1024,128,128) on an
H100 (bench/NOTES.md, session 49); z alone holds 256 MiB there and still saves the N^3 product.

"z alone" is the op's forward with its a/b, x_hat and rstd dropped (ti._trimul_forward wrapped: the op's CUDA
implementation calls it at run time), so the backward recomputes them as it does when nothing was kept.

    PYTHONPATH=. python dev/compiled_keep_ab.py [--shapes "1,768,128,128;1,1024,128,128;1,1024,384,128"]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402

FORWARD = ti._trimul_forward


def z_alone(*args, **kwargs):
    out, z, ab, x_hat, rstd = FORWARD(*args, **kwargs)
    return out, z, None, None, None


def z_and_planes(*args, **kwargs):
    out, z, ab, x_hat, rstd = FORWARD(*args, **kwargs)
    return out, z, ab, None, None


def measure(step, steps: int):
    """(median CUDA-event µs per step, peak MiB above what was allocated before a step): bench.py's helpers."""
    time_us = bench.time_cuda(step, min_reps=steps, budget_s=0.0)[0]
    return time_us, bench.peak_memory_mib(step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=bench.parse_shapes, default="1,768,128,128;1,1024,128,128;1,1024,384,128")
    parser.add_argument("--precision", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        batch, n, c, h = shape
        pair, mask = bench.make_inputs(batch, n, c, g, "cuda")
        pair.requires_grad_(True)
        rows = []
        for name, saves, forward, compiled in (("eager", None, FORWARD, False), ("all", None, FORWARD, True),
                                                ("z and a/b", None, z_and_planes, True),
                                                ("z alone", None, z_alone, True),
                                                ("nothing", "inputs", FORWARD, True)):
            model = ti.ModelNew(c, h, gate_input="normalized", precision=args.precision,
                                backward_saves=saves).cuda()
            ti._trimul_forward = forward
            torch._dynamo.reset()
            trainable = bench.compiled_trainable(model) if compiled else bench.trainable_module(model, model)
            time_us, peak = measure(bench.training_step(trainable, pair, mask), args.steps)
            ti._trimul_forward = FORWARD
            rows.append(f"{name} {time_us:.0f} us {peak:.0f} MiB")
            del model, trainable
            torch.cuda.empty_cache()
        print(f"{','.join(map(str, shape))} {args.precision}: " + "; ".join(rows), flush=True)
        del pair, mask


if __name__ == "__main__":
    main()

"""The host floor of bench.py --backward's training step at a seed shape: what the step costs with (almost) no
layer at all, against the reference's and ModelNew's steps, and ModelNew's step with its forward and backward
captured in CUDA graphs (torch.cuda.make_graphed_callables). Each: median wall µs per step over `--steps` steps
(host-bound steps: the wall time is the step's time), the step as bench.py times it (gradients set to None,
forward, out.float().square().mean().backward()).

    python dev/host_floor.py [--shape 16,32,64,32] [--precision medium] [--steps 200]
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402


def wall_us(step, steps):
    """Median wall µs of `step` over `steps` calls in blocks of 10 (synchronized per block), after warm-up."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    per_block = []
    for _ in range(max(1, steps // 10)):
        start = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        per_block.append((time.perf_counter() - start) / 10 * 1e6)
    return statistics.median(per_block)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="16,32,64,32")
    parser.add_argument("--precision", default="medium")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    batch, n, c, h = (int(x) for x in args.shape.split(","))
    generator = torch.Generator(device="cuda").manual_seed(0)
    ref = bench.randomize(ti.Model(c, h, "outgoing", "normalized").cuda(), generator)
    pair0, mask = bench.make_inputs(batch, n, c, generator, "cuda")
    pair = pair0.clone().requires_grad_(True)
    layerless = lambda forward: bench.Trainable(forward, [], dict)  # noqa: E731
    model = ti.ModelNew(c, h, "outgoing", "normalized", precision=args.precision).cuda()
    model.load_state_dict(ref.state_dict())
    trainables = {"loss only (out = pair * 1)": layerless(lambda p, m: p * 1.0),
                  "loss only (out = pair)": layerless(lambda p, m: p.float()),
                  "reference, eager": bench.trainable_module(ref),
                  "ModelNew": bench.trainable_module(model)}
    try:  # (on a copy: make_graphed_callables replaces a module's forward with the graphed one)
        graphed = torch.cuda.make_graphed_callables(copy.deepcopy(model), (pair0.clone().requires_grad_(True), mask))
        trainables["ModelNew, make_graphed_callables"] = bench.trainable_module(graphed)
    except Exception as error:  # (reported, not fatal: this is a measurement script)
        print(f"make_graphed_callables failed: {type(error).__name__}: {error}")
    rows = {name: bench.training_step(trainable, pair, mask) for name, trainable in trainables.items()}
    print(f"{args.shape} precision={args.precision}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, step in rows.items():
        try:
            print(f"{name:<36} {wall_us(step, args.steps):8.0f} us per step")
        except Exception as error:
            print(f"{name:<36} failed: {type(error).__name__}: {error}")
    if "ModelNew, make_graphed_callables" in rows:
        rows["ModelNew, make_graphed_callables"]()
        got = bench.step_gradients(trainables["ModelNew, make_graphed_callables"], pair)
        errors, _ = bench.gradient_check(got, bench.fp64_gradients(ref, pair0, mask), args.precision)
        name, worst = bench.worst_gradient(errors)
        print(f"graphed step's worst gradient error vs fp64: {worst:.1e} ({name})")

if __name__ == "__main__":
    main()

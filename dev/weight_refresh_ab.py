"""A/B of the weight refresh from a CUDA graph (_WEIGHT_GRAPHS) against op by op: ModelNew's training step as
bench.py --backward times it (parameters marked updated every step, so the kernel-layout weights are prepared
every step), and the refresh alone (host µs of _prepared_weights after a version bump). Alternating blocks of
steps, so that host drift falls on both; median wall µs per step (the small steps are host-bound: wall is the
step's time) and CUDA-event µs for the large ones.

    PYTHONPATH=. python dev/weight_refresh_ab.py [--shapes "16,32,64,32;1,512,128,128"] [--precision medium]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402

GRAPHED = ti._prepared_graphed


def variant(graphed: bool):
    ti._prepared_graphed = GRAPHED if graphed else (lambda params, mode, capture: None)


def step_us(step, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def refresh_us(model, trainable, pair, mode: str, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        bench.clear_gradients(trainable, pair)  # (the parameters marked updated, as a step marks them)
        model._prepared_weights(mode)
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1,32,64,32;16,32,64,32;2,256,128,128;1,512,128,128;1,1024,128,128")
    parser.add_argument("--precision", default="medium,highest")
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(";"):
        batch, n, c, h = map(int, shape.split(","))
        steps = 20 if n <= 256 else 5
        for precision in args.precision.split(","):
            model = ti.ModelNew(c, h, gate_input="normalized", precision=precision).cuda()
            pair = (torch.randn(batch, n, n, c, generator=g) * 2).cuda().requires_grad_(True)
            mask = (torch.rand(batch, n, n, generator=g) > 0.2).cuda()
            trainable = bench.trainable_module(model, model)
            step = bench.training_step(trainable, pair, mask)
            mode = ti.compute_mode(pair.dtype, precision)
            times = {True: [], False: [], "refresh-True": [], "refresh-False": []}
            for graphed in (True, False):  # (warm: captures and first preparations)
                variant(graphed)
                step_us(step, 3)
            for block in range(args.blocks):
                for graphed in ((True, False) if block % 2 == 0 else (False, True)):
                    variant(graphed)
                    times[graphed].append(step_us(step, steps))
                    times[f"refresh-{graphed}"].append(refresh_us(model, trainable, pair, mode, 20))
            variant(True)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{shape} {precision}: step graphed {med[True]:.0f} us, op by op {med[False]:.0f} us "
                  f"({med[False] - med[True]:+.0f}); refresh host graphed {med['refresh-True']:.0f} us, "
                  f"op by op {med['refresh-False']:.0f} us", flush=True)
            del model, trainable, step, pair, mask
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where a small forward's time goes: host (Python + launch) vs GPU, for the seed shapes.

    python bench/host_overhead.py [--precision medium] [--profile]

Per shape it prints: eager µs per call (host loop over many calls, synchronised once: the larger
of host and GPU time per call), the GPU time alone (a CUDA graph of the same forward, replayed),
one bare extension call on prepared arguments, and, with --profile, cProfile's top functions.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def graph_us(fn, calls):
    bench.warm_up_beside(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return per_call_us(graph.replay, calls)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="medium", choices=ti.PRECISIONS)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, precision={args.precision}")
    for batch, n, c, h in ((1, 32, 64, 32), (16, 32, 64, 32)):
        model = ti.ModelNew(c, h, precision=args.precision).cuda().eval()
        pair = torch.randn(batch, n, n, c, device="cuda")
        mask = torch.rand(batch, n, n, device="cuda") > 0.1
        with torch.inference_mode():
            forward = lambda: model(pair, mask)  # noqa: E731
            eager = per_call_us(forward, args.calls)
            gpu = graph_us(forward, args.calls)
            # The extension arguments the eager calls above planned for this signature.
            mode, _, options, _ = model._plans[model._plan_key(pair, mask)]
            bare_args = (pair, mask, model._prepared_weights(mode), options)
            ext = ti._extension()
            bare = per_call_us(lambda: ext.forward(*bare_args), args.calls)
            print(f"({batch},{n},{c},{h}): eager {eager:7.1f} us/call   GPU alone (graph) {gpu:6.1f}"
                  f"   bare extension call {bare:6.1f}")
            if args.profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    forward()
                profiler.disable()
                torch.cuda.synchronize()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())

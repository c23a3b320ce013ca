"""Where the compiled lean step's peak is: the memory allocated (MiB above the step's start) and the peak so far at
the entry and exit of the forward (_trimul_forward) and of the backward's Python steps (_training_backward), for
the eager step and the compiled one, both on the Python steps (training_backward with host="python", which the
op trimul_backward calls too), as bench.py --backward steps them (backward_saves="z": the lean backward).
With dev/compiled_lean_split.diff applied (the backward as two ops), pass --halves to trace its two halves
(_backward_front, _backward_rest) instead (bench/NOTES.md, session 51).

    PYTHONPATH=. python dev/compiled_peak_probe.py [--shape 1,1024,128,128] [--saves z] [--fullgraph] [--halves]
        [--snapshot FILE]
"""
import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402

BASE = [0]


def mib(x):
    return f"{(x - BASE[0]) / 2**20:7.0f}"


def now():
    return f"allocated {mib(torch.cuda.memory_allocated())} peak {mib(torch.cuda.max_memory_allocated())}"


def traced(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        print(f"  {name:>9} in : {now()}")
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        print(f"  {name:>9} out: {now()}")
        return result
    return wrapper


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,1024,128,128")
    parser.add_argument("--saves", default="z")
    parser.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True) (else as bench.py)")
    parser.add_argument("--halves", action="store_true", help="trace _backward_front and _backward_rest")
    parser.add_argument("--snapshot", help="the compiled step's memory snapshot (pytorch.org/memory_viz)")
    args = parser.parse_args()
    batch, n, c, h = map(int, args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    pair, mask = bench.make_inputs(batch, n, c, g, "cuda")
    pair.requires_grad_(True)
    ti._trimul_forward = traced("forward", ti._trimul_forward)
    if args.halves:
        ti._backward_front = traced("front", ti._backward_front)
        ti._backward_rest = traced("rest", ti._backward_rest)
    else:
        ti._training_backward = traced("backward", ti._training_backward)
    ti.training_backward = functools.partial(ti.training_backward, host="python")
    for name, compiled in (("eager (Python steps)", False), ("compiled", True)):
        model = ti.ModelNew(c, h, gate_input="normalized", precision="medium", backward_saves=args.saves).cuda()
        torch._dynamo.reset()
        forward = torch.compile(model, fullgraph=args.fullgraph) if compiled else model
        trainable = bench.trainable_module(model, forward)
        step = bench.training_step(trainable, pair, mask)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        BASE[0] = torch.cuda.memory_allocated()
        print(f"{name}: step start")
        if compiled and args.snapshot:  # (each allocation's stack: what holds the step's memory at its peak)
            torch.cuda.memory._record_memory_history(max_entries=20000)
        step()
        if compiled and args.snapshot:
            torch.cuda.memory._dump_snapshot(args.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.synchronize()
        print(f"{name}: step peak {mib(torch.cuda.max_memory_allocated())} MiB above its start, "
              f"end {mib(torch.cuda.memory_allocated())}", flush=True)
        del model, trainable, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Per-kernel CUDA time of one ModelNew training step (forward, loss, backward), by torch.profiler.

    python dev/backward_profile.py --shape 1,1024,128,128 --precision medium [--gate-input normalized]
        [--copies] [--host] [--runtime] [--bf16]

--bf16: bf16 parameters and inputs (bench.py's new-bf16 row) instead of fp32 at --precision.

--graphed: also the step captured whole in one CUDA graph (bench.py --backward --cuda-graph's): one replay's
kernels, and its replay time against their sum (the rest: the gaps between kernels).

--copies: the PyTorch ops that launched device copies and elementwise kernels (with their input shapes and
Python stacks); --host: the step's wall time against its CUDA time, synchronised and back to back (a small
step is host-bound); --runtime: the CUDA runtime calls the step makes on the host, by their host time (a
blocking one shows as a long call).
"""
import time
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,1024,128,128")
    parser.add_argument("--precision", default="medium")
    parser.add_argument("--gate-input", default="normalized")
    parser.add_argument("--kernels", default=None)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--copies", action="store_true")
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--runtime", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--graphed", action="store_true")
    args = parser.parse_args()
    batch, n, pair_dim, hidden = (int(x) for x in args.shape.split(","))
    model = ti.ModelNew(pair_dim, hidden, gate_input=args.gate_input, precision=args.precision,
                        kernels=args.kernels).cuda()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = model.to(dtype)
    pair = torch.randn(batch, n, n, pair_dim, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.rand(batch, n, n, device="cuda") > 0.1

    def step():
        model.zero_grad(set_to_none=True)
        pair.grad = None
        model(pair, mask).float().square().mean().backward()

    mode = "bf16" if args.bf16 else args.precision
    print_kernels(step, f"{args.shape} {mode} {args.gate_input}", args.rows)
    if args.graphed:
        print_graphed(model, pair, mask, f"{args.shape} {mode} {args.gate_input}", args.rows)
    if args.copies:
        print_copies(step)
    if args.host:
        print_host_time(step)
    if args.runtime:
        print_runtime_calls(step)


def print_kernels(step, label: str, rows: int) -> None:
    """One step's CUDA kernels (after three warm-up steps), by total time."""
    events = step_kernel_events(step)
    total = sum(e.device_time_total for e in events)
    launches = sum(e.count for e in events)
    print(f"{label}: {total:.0f} us of CUDA time in {launches} launches of {len(events)} kernels")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:rows]:
        print(f"{e.device_time_total:9.1f} us  {e.count:3d}x  {e.key[:110]}")


def print_graphed(model, pair, mask, label: str, rows: int) -> None:
    """The step captured whole in one CUDA graph (bench.graphed_training_step): one replay's kernels, and the
    replay's median time (bench.time_cuda) against their sum."""
    import bench
    replay, pool_mib = bench.graphed_training_step(bench.trainable_module(model), pair, mask)
    median = bench.time_cuda(replay)[0]
    print(f"\ngraphed step: replay {median:.0f} us (median), pool {pool_mib:.0f} MiB")
    print_kernels(replay, f"{label}, one replay", rows)


def step_kernel_events(step) -> list:
    """One step's CUDA kernels (torch.profiler's averages by name) after three warm-up steps."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


def back_to_back(step, repeats: int = 20):
    """Steps back to back, as bench.py times them: (median µs per step by each step's CUDA events, the host's issue
    time per step, its wall time per step)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for begin, finish in events:
        begin.record()
        step()
        finish.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    per_step = lambda seconds: seconds / repeats * 1e6  # noqa: E731
    median = sorted(b.elapsed_time(f) for b, f in events)[repeats // 2] * 1e3
    return median, per_step(t1 - t0), per_step(time.perf_counter() - t0)


def print_copies(step) -> None:
    """The CPU-side ops that moved data (copies, clones, casts, elementwise), by input shapes and stack."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    wanted = ("aten::copy_", "aten::clone", "aten::_to_copy", "aten::contiguous", "aten::mul", "aten::add",
              "aten::sub", "aten::addmm", "aten::cat", "aten::pow", "aten::mean", "aten::sum")
    rows = [e for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=4)
            if e.key in wanted and e.self_device_time_total > 20]
    print("ops launching device work (self CUDA us, count, op, input shapes, stack):")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total):
        stack = " <- ".join(frame.split("(")[0].split("/")[-1] + ":" + frame.split("(")[-1].split(")")[0]
                            for frame in e.stack[:4])
        print(f"{e.self_device_time_total:9.1f} us {e.count:3d}x {e.key} {e.input_shapes} {stack}")


def print_runtime_calls(step, repeats: int = 5) -> None:
    """The CUDA runtime and driver calls of `repeats` steps by host time, and the host ops by their own time."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith(("cu", "Memcpy"))]
    print(f"CUDA runtime calls over {repeats} steps (host us total, count, mean):")
    for e in sorted(rows, key=lambda e: -e.cpu_time_total)[:20]:
        print(f"{e.cpu_time_total:9.1f} us {e.count:4d}x {e.cpu_time_total / e.count:8.1f}  {e.key[:80]}")
    ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "trimul"))]
    print("host ops by self CPU time (us total, count):")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:25]:
        print(f"{e.self_cpu_time_total:9.1f} us {e.count:4d}x  {e.key[:80]}")


def print_host_time(step, repeats: int = 20) -> None:
    """Wall time per step (synchronised) against the CUDA time between events around it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls, gpus, issues = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        issues.append(t1 - t0)
        gpus.append(start.elapsed_time(end) * 1e-3)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6  # noqa: E731
    print(f"host: wall {med(walls):.0f} us per step, issue {med(issues):.0f} us, events {med(gpus):.0f} us "
          f"(median of {repeats})")
    events, issue, wall = back_to_back(step, repeats)
    print(f"back to back: events {events:.0f} us per step (median), host issue {issue:.0f} us per step, wall {wall:.0f}")
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # (the backward's Python on this thread, profiled)
        profiler.enable()
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
        profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"Python functions over {repeats} steps, by own time:")
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()

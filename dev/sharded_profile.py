"""dev/sharded_profile.py — where the sharded forward's time goes on one GPU: ModelNew(process_group=...) with a
group of one rank (NCCL: the ring moves nothing, so what is left is the per-rank compute), against the fused forward
of the same layer in the same process; then the top CUDA kernels of one sharded forward (torch.profiler), and the
training step of both at a smaller N (time and peak above the inputs), the sharded one keeping its layers'
intermediates (backward_saves="z"), recomputing them by row steps, and on the backward kernels for a block of rows
(the default where they take the call).

    PYTHONPATH=. python dev/sharded_profile.py [--n 4096] [--train-n 2048] [--direction outgoing]
"""
import argparse
import datetime
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402


def inputs(n: int):
    pair = torch.randn(1, n, n, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(1, n, n, device="cuda") > 0.1
    return pair, mask


def layers(direction: str, group, backward_saves=None):
    torch.manual_seed(0)
    return ti.ModelNew(128, 128, direction, "normalized", process_group=group,
                       backward_saves=backward_saves).cuda().to(torch.bfloat16)


def forward_times(n: int, direction: str, group) -> None:
    pair, mask = inputs(n)
    for name, pg in (("fused", None), ("sharded P=1", group)):
        model = layers(direction, pg)
        with torch.no_grad():
            median, p10, p90 = bench.time_cuda(lambda: model(pair, mask), min_reps=3, budget_s=0.0)[:3]
            peak = bench.peak_memory_mib(lambda: model(pair, mask))
        print(f"N={n} {direction} forward {name:12s} {median / 1e3:8.2f} ms (p10-p90 {p10 / 1e3:.2f}-{p90 / 1e3:.2f}) "
              f"peak {peak:7.0f} MiB above the inputs", flush=True)
        if pg is not None:
            with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model(pair, mask)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70),
                  flush=True)
        del model
        torch.cuda.empty_cache()


def step_times(n: int, direction: str, group) -> None:
    pair, mask = inputs(n)
    for name, pg, saves in (("fused", None, None), ("sharded P=1", group, "z"), ("sharded, row steps", group, "inputs"),
                            ("sharded, block kernels", group, None)):
        model = layers(direction, pg, saves)
        if name.endswith("row steps"):  # (the PyTorch layers by row steps, where the block kernels would run)
            model._sharded_trained = lambda *args: None
        leaf = pair.clone().requires_grad_()

        def step():
            for p in model.parameters():
                p.grad = None
            leaf.grad = None
            model(leaf, mask).float().square().mean().backward()
        median, p10, p90 = bench.time_cuda(step, min_reps=3, budget_s=0.0)[:3]
        peak = bench.peak_memory_mib(step)
        print(f"N={n} {direction} training step {name:20s} {median / 1e3:8.2f} ms (p10-p90 {p10 / 1e3:.2f}-"
              f"{p90 / 1e3:.2f}) peak {peak:7.0f} MiB above the inputs", flush=True)
        del model, leaf
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--train-n", type=int, default=2048)
    parser.add_argument("--direction", choices=ti.DIRECTIONS, default="outgoing")
    args = parser.parse_args()
    import torch.distributed as dist
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("nccl", init_method=f"file://{store.name}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda:0"))
        try:
            forward_times(args.n, args.direction, dist.group.WORLD)
            step_times(args.train_n, args.direction, dist.group.WORLD)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

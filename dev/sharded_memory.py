"""dev/sharded_memory.py — the sharded forward's per-rank peak of live tensor bytes, counted on the CPU (gloo).

    python dev/sharded_memory.py [--world 2] [--n 96] [--dim 32] [--dtype bf16] [--exchange channels]
                                 [--training [--backward-saves inputs]]

Each rank runs ModelNew(process_group=...) without gradients (--training: its training step) under a dispatch mode that follows every tensor
storage the forward creates (freed: its weak reference expired) and prints the largest sum of live bytes above the
inputs, in units of the rank's pair block (B x N_r x N x C elements), for both directions. The same Python code
runs on GPUs, where the planes, blocks and buffers are the same tensors; so the multiple here is what the GPU's
per-rank peak should be, short of kernel workspaces (the outgoing GPU run: 8481 MiB = 4.14 pair blocks at
(1,4096,128,128) bf16, P = 2). One process per rank on a machine of two cores: keep N small.
"""
import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402
from test_trimul import LiveBytes  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def worker(rank, world, store, args):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        dtype, rows = DTYPES[args.dtype], ti.shard_rows(args.n, world, rank)
        ti.SHARDED_STEP_MIN_BYTES = 1  # (the no-gradient layers' steps sized as at large N, not by the floor)
        for direction in ti.DIRECTIONS:
            model = ti.ModelNew(args.dim, args.dim, direction, "normalized", process_group=dist.group.WORLD,
                                shard_exchange=args.exchange, backward_saves=args.backward_saves).to(dtype)
            g = torch.Generator().manual_seed(rank)
            pair = torch.randn(1, len(rows), args.n, args.dim, generator=g).to(dtype)
            mask = torch.ones(1, len(rows), args.n, dtype=torch.bool)
            if args.training:  # (the forward and the backward of the training step; the input's gradient counted)
                pair.requires_grad_()
                model(pair, mask).float().square().mean().backward()
                counter = LiveBytes([pair, mask, *model.parameters(), *(p.grad for p in model.parameters())])
                with counter:
                    model(pair, mask).float().square().mean().backward()
            else:
                with torch.no_grad():
                    model(pair, mask)  # (warm: one-time buffers out of the count)
                    counter = LiveBytes([pair, mask, *model.parameters()])
                    with counter:
                        model(pair, mask)
            block = pair.numel() * pair.element_size()
            op, sizes = counter.at
            print(f"rank {rank}/{world} {direction} {model.shard_exchange or 'rule'} N={args.n} C=H={args.dim} "
                  f"{args.dtype}: peak {counter.peak / block:.2f} "
                  f"pair blocks ({counter.peak / 2**20:.2f} MiB) after {op}; the largest live, in blocks: "
                  f"{[(round(size / block, 2), made) for size, made in sizes[:8]]}", flush=True)
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n", type=int, default=96)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--exchange", choices=ti.SHARD_EXCHANGES, help="default: ti.shard_exchange_for's rule")
    parser.add_argument("--training", action="store_true", help="the training step (forward and backward)")
    parser.add_argument("--backward-saves", choices=ti.BACKWARD_SAVES, help="the model's (training)")
    args = parser.parse_args()
    import tempfile
    store = os.path.join(tempfile.mkdtemp(), "store")
    torch.multiprocessing.spawn(worker, args=(args.world, store, args), nprocs=args.world)


if __name__ == "__main__":
    main()

"""bench/distributed.py — the sharded triangle update (ModelNew(process_group=...)) timed on every rank.

    torchrun --nproc-per-node=2 bench/distributed.py --shapes "1,4096,128,128" --dtype bf16 [--backward]
    torchrun --nproc-per-node=2 bench/distributed.py --backend gloo --device cpu --shapes "1,64,32,16"   # CPU

Per shape, on each rank: the forward (and with --backward the training step: loss = mean of out², backward)
timed after warm-up (CUDA events on GPUs, wall clock on the CPU; median and p10-p90 over repetitions); the
sharded contraction alone, its products alone and its transfers alone, hence the share of the transfers hidden
behind the products; bytes sent per rank; peak memory per rank (CUDA); the point-to-point bandwidth from rank 0
to rank 1. Rank 0 prints one line per shape; --json writes every rank's.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402
from bench import parse_shapes  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Clock:
    """Elapsed seconds of fn(): CUDA events on a GPU, wall clock (after a barrier) on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        dist.barrier()
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def timed(clock, fn, reps):
    for _ in range(2):
        fn()
    times = sorted(clock(fn) for _ in range(reps))
    return {"median_ms": 1e3 * statistics.median(times), "p10_ms": 1e3 * times[len(times) // 10],
            "p90_ms": 1e3 * times[(9 * len(times)) // 10]}


def transfer_bytes(ring, batch, n, hidden, element, incoming):
    """Bytes this rank sends in one forward: the blocks it passes on round the ring both ways (P - 1 blocks in
    all: rank - d's rightwards, rank + d's leftwards) and the incoming direction's all-to-all of a."""
    rows = ring.counts[ring.rank]
    world, rank = ring.world, ring.rank
    ring_bytes = sum(ring.counts[(rank - d) % world] for d in range(world // 2)) + \
        sum(ring.counts[(rank + d) % world] for d in range((world - 1) // 2))
    total = ring_bytes * n * hidden * batch * element
    if incoming:
        total += rows * (n - rows) * hidden * batch * element
    return total


def transfers_only(ring, batch, n, hidden, dtype, device, incoming):
    """The forward's transfers without the products (the same shifts and all-to-all)."""
    rows = ring.counts[ring.rank]
    block = torch.zeros(batch, hidden, rows, n, dtype=dtype, device=device)

    def run():
        if incoming:
            ring.all_to_all([block[..., c] for c in ring.columns])
        ti._ring_products(ring, block, lambda b, s: None, 2)
    return run


def contraction_parts(ring, batch, n, hidden, dtype, device, incoming):
    """Three callables on random planes of this rank's rows: the sharded contraction as the forward runs it,
    its products alone (every block's product, on blocks already here: no transfers) and its transfers alone.
    The share of the transfers hidden behind the products: (products + transfers - contraction) / transfers."""
    rows = ring.counts[ring.rank]
    planes = lambda r, c: torch.randn(batch, hidden, r, c, device=device).to(dtype)  # noqa: E731
    a_t, b_t = planes(rows, n), planes(rows, n)
    a_cols = planes(n, rows)  # (incoming: a's column block after the all-to-all)
    blocks = [planes(ring.counts[s], n) for s in range(ring.world)]
    columns = ring.columns

    def products():
        for s, block in enumerate(blocks):
            if incoming:
                a_cols[:, :, columns[s]].transpose(-1, -2) @ block
            else:
                a_t @ block.transpose(-1, -2)
    return (lambda: ti._ShardedContraction.apply(a_t, b_t, ring, incoming), products,
            transfers_only(ring, batch, n, hidden, dtype, device, incoming))


def bandwidth(device, megabytes=256):
    """GB/s of a send from rank 0 to rank 1 (one direction), timed on rank 1."""
    if dist.get_world_size() < 2:
        return None
    if dist.get_backend() == "gloo":  # (gloo's point-to-point calls take CPU tensors only: its TCP rate)
        device = torch.device("cpu")
    buffer = torch.empty(megabytes << 18, dtype=torch.float32, device=device)
    clock = Clock(device)
    rank = dist.get_rank()

    def run():
        if rank == 0:
            dist.send(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
    seconds = timed(clock, run, 5)["median_ms"] / 1e3  # (every rank: the CPU clock's barriers are collective)
    return None if rank != 1 else buffer.numel() * 4 / seconds / 1e9


def bench_shape(shape, args, device):
    batch, n, pair_dim, hidden = shape
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    model = ti.ModelNew(pair_dim, hidden, args.direction, "normalized", precision=args.precision,
                        process_group=dist.group.WORLD).to(device=device, dtype=dtype)
    rows = ti.shard_rows(n, world, rank)
    g = torch.Generator().manual_seed(0)
    pair = torch.randn(batch, len(rows), n, pair_dim, generator=g).to(device=device, dtype=dtype)
    mask = torch.ones(batch, len(rows), n, dtype=torch.bool, device=device)
    clock = Clock(device)
    ring = ti._Ring(dist.group.WORLD, n, device)
    incoming = args.direction == "incoming"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.no_grad():
        forward = timed(clock, lambda: model(pair, mask), args.reps)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
    contraction, products, transfers = contraction_parts(ring, batch, n, hidden, dtype, device, incoming)
    with torch.no_grad():
        result = {"rank": rank, "rows": len(rows), "forward": forward,
                  "bytes_sent": transfer_bytes(ring, batch, n, hidden, pair.element_size(), incoming),
                  "contraction": timed(clock, contraction, args.reps), "products": timed(clock, products, args.reps),
                  "transfers": timed(clock, transfers, args.reps)}
    moving = result["transfers"]["median_ms"]
    overlap = result["products"]["median_ms"] + moving - result["contraction"]["median_ms"]
    result["hidden_share"] = min(1.0, max(0.0, overlap / moving)) if moving > 0 else float("nan")
    result["peak_mib_forward"] = peak  # (the forward's alone: the parts below allocate planes of their own)
    if args.backward:
        leaf = pair.clone().requires_grad_()

        def step():
            model.zero_grad(set_to_none=True)
            model(leaf, mask).float().square().mean().backward()
        result["training_step"] = timed(clock, step, args.reps)
    return gather_results(result, device)


_FIELDS = ("rows", "bytes_sent", "peak_mib_forward", "hidden_share")
_TIMES = ("forward", "contraction", "products", "transfers", "training_step")


def gather_results(result, device):
    """Every rank's result dict (numbers only) on every rank, through one all-gather of a float64 vector
    (all_gather_object needs numpy, which the machines may not have)."""
    values = [float(result.get(k) if result.get(k) is not None else float("nan")) for k in _FIELDS]
    for name in _TIMES:
        times = result.get(name, {})
        values += [times.get(k, float("nan")) for k in ("median_ms", "p10_ms", "p90_ms")]
    mine = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    out = []
    for rank, vector in enumerate(gathered):
        v = vector.tolist()
        entry = {"rank": rank, **{k: v[i] for i, k in enumerate(_FIELDS)}}
        for j, name in enumerate(_TIMES):
            base = len(_FIELDS) + 3 * j
            if v[base] == v[base]:  # (not NaN: timed)
                entry[name] = {"median_ms": v[base], "p10_ms": v[base + 1], "p90_ms": v[base + 2]}
        out.append(entry)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1,4096,128,128"))
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--precision", default="medium")
    parser.add_argument("--direction", choices=ti.DIRECTIONS, default="outgoing")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    parser.add_argument("--device", default=None, help="default: cuda:<LOCAL_RANK> where CUDA exists, else cpu")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(args.device or (f"cuda:{local}" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    try:
        report = {"command": " ".join(sys.argv), "world": dist.get_world_size(), "backend": backend,
                  "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                  "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "bandwidth_gbps_0_to_1": None, "shapes": {}}
        rate = torch.tensor([bandwidth(device) or 0.0], dtype=torch.float64,
                            device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(rate)  # (only rank 1's is not zero)
        report["bandwidth_gbps_0_to_1"] = rate.item() if dist.get_world_size() > 1 else None
        for shape in args.shapes:
            ranks = bench_shape(shape, args, device)
            report["shapes"][",".join(map(str, shape))] = ranks
            if dist.get_rank() == 0:
                slowest = max(r["forward"]["median_ms"] for r in ranks)
                print(f"{shape} P={len(ranks)} {args.dtype} {args.direction}: forward {slowest:.2f} ms (slowest "
                      f"rank), contraction {max(r['contraction']['median_ms'] for r in ranks):.2f} ms, its "
                      f"transfers alone {max(r['transfers']['median_ms'] for r in ranks):.2f} ms, hidden "
                      f"{min(r['hidden_share'] for r in ranks):.0%} (least of the ranks), "
                      f"{max(r['bytes_sent'] for r in ranks) / 1e6:.1f} MB sent per rank"
                      + (f", training step {max(r['training_step']['median_ms'] for r in ranks):.2f} ms"
                         if args.backward else "")
                      + (f", peak {max(r['peak_mib_forward'] for r in ranks):.0f} MiB"
                         if ranks[0]["peak_mib_forward"] == ranks[0]["peak_mib_forward"] else ""), flush=True)
        if dist.get_rank() == 0:
            print(f"point-to-point bandwidth rank 0 -> 1: {report['bandwidth_gbps_0_to_1']} GB/s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
        dist.barrier()  # (no rank tears its connections down while a peer still uses them)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

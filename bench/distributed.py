"""bench/distributed.py — the sharded triangle update (ModelNew(process_group=...)) timed on every rank.

    torchrun --nproc-per-node=8 bench/distributed.py --shapes "1,4096,128,128;1,8192,128,128" --jsonl r.jsonl
    torchrun --nproc-per-node=2 bench/distributed.py --backend gloo --device cpu --shapes "1,64,32,16" --jsonl r.jsonl
    python bench/distributed.py --summarize r.jsonl [--fused "4096=38.4,8192=257"]   # the table

Every rank appends one JSON line per measurement to --jsonl as soon as it has it, so a failure or a timeout
later keeps what was measured: the run (command, date, device, torch, commit), the links (one way rank 0 -> 1,
and the ring's exchange: every rank sending to both neighbours at once, as the contraction's ring does), then
per shape, smallest first: the forward and (--backward) the training step (loss = mean of out², backward),
each timed after warm-up (CUDA events on GPUs, wall clock on the CPU; median and p10-p90) with its peak memory
(all of it, and above the inputs); the sharded contraction alone, its products alone (the same calls on a ring
that moves nothing) and its transfers alone, hence the share of the transfers hidden behind the products; bytes
sent per rank by the forward and the backward. Rank 0 prints one line per shape. A world of one rank is the
P = 1 baseline of the same code. --summarize reads the lines of any number of runs and prints the efficiency
table: forward (and step) time of the slowest rank, efficiency against P = 1 of the same N (where P = 1 ran;
else "~" from the largest N that did, scaled by N³) and against the fused one-GPU forward (--fused), the
prediction of bench/shard_model.py, bytes, hidden share, peak per rank.
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
from bench import git_commit, parse_shapes, spread, trainable_module, training_step  # noqa: E402

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
    low, high = spread(times)
    return {"median_ms": 1e3 * statistics.median(times), "p10_ms": 1e3 * low, "p90_ms": 1e3 * high}


class Log:
    """Appends this rank's records, one JSON line each, flushed at once (every rank to the same file)."""

    def __init__(self, path, common):
        self.path, self.common = path, common

    def __call__(self, **record):
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({**self.common, **record}) + "\n")


def _ring_sends(ring) -> int:
    """Rows of blocks this rank sends round the ring both ways in one pass (rank - d's rightwards, rank + d's
    leftwards: P - 1 blocks in all)."""
    world, rank = ring.world, ring.rank
    return sum(ring.counts[(rank - d) % world] for d in range(world // 2)) + \
        sum(ring.counts[(rank + d) % world] for d in range((world - 1) // 2))


def _channel_sends(ring, batch, n, hidden, element):
    """By the channel exchange, the bytes of one operand this rank sends (to the channels' owners: its rows of
    the others' channels; back to the rows' owners: its channels of the others' rows)."""
    owned = [len(ti.shard_rows(hidden, ring.world, s)) for s in range(ring.world)]
    rows, rank = ring.counts[ring.rank], ring.rank
    to_channels = rows * (hidden - owned[rank]) * n * batch * element
    to_rows = owned[rank] * (n - rows) * n * batch * element
    return to_channels, to_rows


def transfer_bytes(ring, batch, n, hidden, element, incoming):
    """Bytes this rank sends in one forward: b's blocks round the ring and incoming's all-to-all of a; or, by
    the channel exchange, a and b to their channels' owners and z's rows back."""
    if ring.exchange == "channels":
        to_channels, to_rows = _channel_sends(ring, batch, n, hidden, element)
        return 2 * to_channels + to_rows
    rows = ring.counts[ring.rank]
    total = _ring_sends(ring) * n * hidden * batch * element
    if incoming:
        total += rows * (n - rows) * hidden * batch * element
    return total


def backward_bytes(ring, batch, n, hidden, element, incoming):
    """Bytes this rank sends in one backward (_ShardedContraction._backward): b's blocks round the ring again,
    d b's accumulators round the one-way ring (one block of each other rank's rows) and incoming's inverse
    all-to-all of d a. By the channel exchange: d z to the channels' owners, d a and d b back."""
    if ring.exchange == "channels":
        to_channels, to_rows = _channel_sends(ring, batch, n, hidden, element)
        return to_channels + 2 * to_rows
    world, rank, rows = ring.world, ring.rank, ring.counts[ring.rank]
    reduce_rows = sum(ring.counts[(rank - step - 1) % world] for step in range(world - 1))
    total = (_ring_sends(ring) + reduce_rows) * n * hidden * batch * element
    if incoming:
        total += rows * (n - rows) * hidden * batch * element
    return total


class SilentRing(ti._Ring):
    """A ring whose transfers move nothing: each shift and all-to-all hands back an uninitialised block of the
    shape the real one receives (the same allocations), and the channel exchange's receives are left as they
    are, so the sharded contraction on it is its products alone: the same kernels on the same shapes, no
    waiting."""

    def __init__(self, group, n, device, exchange):
        super().__init__(group, n, device, exchange)
        self.stage = False

    def start_exchange(self, units, bound, tag):
        return lambda: None

    def shift(self, block, incoming_rows, row_dim, step=1):
        shape = list(block.shape)
        shape[row_dim] = incoming_rows
        received = block.new_empty(shape)
        return lambda: received

    def start_all_to_all(self, chunks, keep_own=True):
        received = [None if s == self.rank else chunks[0].new_empty(c.shape[:-2] + (c.shape[-1], c.shape[-2]))
                    for s, c in enumerate(chunks)]
        received[self.rank] = chunks[self.rank] if keep_own else None
        return lambda: list(received)


def transfers_only(ring, batch, n, hidden, dtype, device, incoming):
    """The forward's transfers without the products (the same shifts and all-to-all; or the channel exchange's
    groups, each group's z sent back as it arrives)."""
    rows = ring.counts[ring.rank]
    block = torch.zeros(batch, hidden, rows, n, dtype=dtype, device=device)

    def run():
        if ring.exchange == "channels":
            z_t = torch.empty_like(block)
            parts = ti._channel_parts(hidden, ring.world)
            for part in parts:
                a_c, _ = ti._start_to_channels(ring, [block, block], part)()
                ti._start_to_rows(ring, [a_c], part, [z_t])()
            return
        if incoming:
            ring.all_to_all([block[..., c] for c in ring.columns])
        ti._ring_products(ring, block, lambda b, s: None, 2)
    return run


def contraction_parts(ring, silent, batch, n, hidden, dtype, device, incoming):
    """(the sharded contraction as the forward runs it, its products alone, its transfers alone) on random
    planes of this rank's rows. Hidden share: (products + transfers - contraction) / transfers."""
    rows = ring.counts[ring.rank]
    a_t = torch.randn(batch, hidden, rows, n, device=device, dtype=dtype)
    b_t = torch.randn(batch, hidden, rows, n, device=device, dtype=dtype)
    return (lambda: ti._ShardedContraction.apply(a_t, b_t, ring, incoming),
            lambda: ti._ShardedContraction.apply(a_t, b_t, silent, incoming),
            transfers_only(ring, batch, n, hidden, dtype, device, incoming))


def link_rates(device, log, megabytes=256):
    """GB/s of a send from rank 0 to rank 1 alone, of the ring's exchange (every rank sending a block to
    rank + 1 and one to rank - 1 at once, receiving two: the contraction ring's pattern), per direction and
    out of each GPU in all, and of an all-to-all (the channel exchange's pattern) out of each GPU. Logged by
    every rank; returned for rank 0's line."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    if dist.get_backend() == "gloo":  # (gloo's point-to-point calls take CPU tensors only: its TCP rate)
        device = torch.device("cpu")
    block = torch.empty(megabytes << 19, dtype=torch.bfloat16, device=device)
    clock = Clock(device)
    ring = ti._Ring(dist.group.WORLD, 0, device)

    def one_way():
        if rank == 0:
            dist.send(block, 1)
        elif rank == 1:
            dist.recv(block, 0)

    def exchange():
        waits = [ring.shift(block, block.shape[0], 0, 1)]
        if world > 2:
            waits.append(ring.shift(block, block.shape[0], 0, -1))
        for wait in waits:
            wait()
    # (the channel exchange's pattern: one piece to each other rank and one from each, all at once)
    pieces = block[:block.numel() // (world - 1) * (world - 1)].view(world - 1, -1)
    landed = torch.empty_like(pieces)
    others = [s for s in range(world) if s != rank]

    def all_to_all():
        ring.start_exchange([([(pieces[i], s) for i, s in enumerate(others)],
                              [(landed[i], s) for i, s in enumerate(others)])], 2 * len(others), 5)()
    bytes_ = block.numel() * block.element_size()
    one = bytes_ / (timed(clock, one_way, 5)["median_ms"] / 1e3) / 1e9
    seconds = timed(clock, exchange, 5)["median_ms"] / 1e3
    spread_seconds = timed(clock, all_to_all, 5)["median_ms"] / 1e3
    directions = 2 if world > 2 else 1
    rates = {"one_way_0_to_1_gbps": one if rank == 1 else None, "ring_per_direction_gbps": bytes_ / seconds / 1e9,
             "ring_out_of_gpu_gbps": directions * bytes_ / seconds / 1e9,
             "all_to_all_out_of_gpu_gbps": pieces.numel() * pieces.element_size() / spread_seconds / 1e9}
    log(kind="links", **rates)
    gathered = torch.tensor([one if rank == 1 else 0.0, rates["ring_per_direction_gbps"],
                             rates["all_to_all_out_of_gpu_gbps"]], dtype=torch.float64,
                            device=device if device.type == "cuda" else "cpu")
    values = [torch.empty_like(gathered) for _ in range(world)]
    dist.all_gather(values, gathered)
    return values[1][0].item(), min(v[1].item() for v in values), directions, min(v[2].item() for v in values)


def memory_probe(device):
    """(start(), stop() -> (peak MiB above what was allocated at start, peak MiB in all)) on CUDA; Nones else."""
    if device.type != "cuda":
        return (lambda: None), (lambda: (None, None))
    state = {}

    def start():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        state["base"] = torch.cuda.memory_allocated()

    def stop():
        peak = torch.cuda.max_memory_allocated()
        return (peak - state["base"]) / 2**20, peak / 2**20
    return start, stop


def bench_shape(shape, args, exchange, device, log):
    """Every measurement of one shape on this rank, each logged as soon as it is made; rank 0's summary values."""
    batch, n, pair_dim, hidden = shape
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    model = ti.ModelNew(pair_dim, hidden, args.direction, args.gate_input, precision=args.precision,
                        process_group=dist.group.WORLD, shard_exchange=exchange,
                        backward_saves=args.backward_saves).to(device=device, dtype=dtype)
    rows = ti.shard_rows(n, world, rank)
    g = torch.Generator(device).manual_seed(rank)  # (drawn where it lives, in its dtype: no fp32 copy on the host)
    pair = torch.randn(batch, len(rows), n, pair_dim, generator=g, device=device, dtype=dtype)
    mask = torch.ones(batch, len(rows), n, dtype=torch.bool, device=device)
    clock = Clock(device)
    start, stop = memory_probe(device)
    incoming = args.direction == "incoming"
    key = {"shape": list(shape), "rows": len(rows)}
    inputs_mib = (pair.numel() * pair.element_size() + mask.numel()) / 2**20
    start()
    with torch.no_grad():
        forward = timed(clock, lambda: model(pair, mask), args.reps)
    above, total = stop()
    log(kind="forward", **key, **forward, peak_above_inputs_mib=above, peak_mib=total, inputs_mib=inputs_mib)
    summary = {"forward_ms": forward["median_ms"], "peak_mib": total}
    if args.backward:
        leaf = pair.clone().requires_grad_()
        # bench.py --backward's step (d pair and the parameters' gradients released, the parameters marked
        # updated), so that the fused one-GPU step's numbers compare; a d pair kept from the step before would
        # add a pair block to the peak and an accumulation to the time.
        step = training_step(trainable_module(model), leaf, mask)
        start()
        training = timed(clock, step, args.reps)
        above, total = stop()
        log(kind="training_step", **key, **training, peak_above_inputs_mib=above, peak_mib=total,
            inputs_mib=inputs_mib)
        summary.update(step_ms=training["median_ms"], step_peak_mib=total)
        del leaf, step
        model.zero_grad(set_to_none=True)
    del pair, mask, model
    ring = ti._Ring(dist.group.WORLD, n, device, exchange)
    silent = SilentRing(dist.group.WORLD, n, device, exchange)
    element = DTYPES[args.dtype].itemsize
    parts = contraction_parts(ring, silent, batch, n, hidden, dtype, device, incoming)
    with torch.no_grad():
        measured = {name: timed(clock, fn, args.reps) for name, fn in zip(("contraction", "products", "transfers"),
                                                                            parts)}
    del parts
    moving = measured["transfers"]["median_ms"]
    hidden_share = (measured["products"]["median_ms"] + moving - measured["contraction"]["median_ms"]) / moving \
        if moving > 0 and world > 1 else None
    sent = transfer_bytes(ring, batch, n, hidden, element, incoming)
    log(kind="contraction_parts", **key, **{f"{k}_{s}": v[s] for k, v in measured.items()
                                            for s in ("median_ms", "p10_ms", "p90_ms")},
        hidden_share=hidden_share, bytes_forward=sent,
        bytes_backward=backward_bytes(ring, batch, n, hidden, element, incoming))
    summary.update(contraction_ms=measured["contraction"]["median_ms"], transfers_ms=moving,
                   hidden_share=float("nan") if hidden_share is None else hidden_share, bytes_forward=sent)
    return summary


_SUMMARY = ("forward_ms", "peak_mib", "step_ms", "step_peak_mib", "contraction_ms", "transfers_ms", "hidden_share",
            "bytes_forward")


def rank_summaries(summary, device):
    """Every rank's summary values on every rank (one all-gather of a float64 vector; NaN where not measured)."""
    mine = torch.tensor([float("nan") if summary.get(k) is None else float(summary[k]) for k in _SUMMARY],
                        dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [dict(zip(_SUMMARY, v.tolist())) for v in gathered]


def _worst(ranks, key, pick=max):
    values = [r[key] for r in ranks if r[key] == r[key]]
    return pick(values) if values else None


def shape_line(shape, args, ranks) -> str:
    exchange = args.exchange or ti.shard_exchange_for(args.direction, len(ranks))
    parts = [f"{tuple(shape)} P={len(ranks)} {args.dtype} {args.direction} {exchange}: forward "
             f"{_worst(ranks, 'forward_ms'):.2f} ms (slowest rank)"]
    if _worst(ranks, "step_ms") is not None:
        parts.append(f"training step {_worst(ranks, 'step_ms'):.2f} ms")
    parts.append(f"contraction {_worst(ranks, 'contraction_ms'):.2f} ms, its transfers alone "
                 f"{_worst(ranks, 'transfers_ms'):.2f} ms")
    if _worst(ranks, "hidden_share", min) is not None:
        parts.append(f"hidden {_worst(ranks, 'hidden_share', min):.0%} (least of the ranks)")
    parts.append(f"{_worst(ranks, 'bytes_forward') / 1e6:.1f} MB sent per rank")
    if _worst(ranks, "peak_mib") is not None:
        parts.append(f"peak {_worst(ranks, 'peak_mib'):.0f} MiB per rank in all")
    return ", ".join(parts)


def run(args):
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(args.device or (f"cuda:{local}" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    # (a rank that fails leaves the others in a collective: the group's timeout ends their wait)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        exchange = args.exchange or ti.shard_exchange_for(args.direction, world)
        log = Log(args.jsonl, {"world": world, "rank": rank, "direction": args.direction, "dtype": args.dtype,
                               "precision": args.precision, "gate_input": args.gate_input, "exchange": exchange,
                               "backward_saves": args.backward_saves})
        log(kind="run", command=" ".join(sys.argv), backend=backend, torch=torch.__version__,
            device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=args.commit or git_commit())
        rates = link_rates(device, log) if args.links else None
        if rank == 0 and rates:
            print(f"links: rank 0 -> 1 alone {rates[0]:.1f} GB/s; ring exchange {rates[1]:.1f} GB/s per direction "
                  f"(slowest rank), {rates[1] * rates[2]:.1f} GB/s out of each GPU; all-to-all {rates[3]:.1f} GB/s "
                  "out of each GPU (slowest rank)", flush=True)
        for shape in sorted(args.shapes, key=lambda s: s[0] * s[1] ** 3 * s[3]):
            ranks = rank_summaries(bench_shape(shape, args, exchange, device, log), device)
            if rank == 0:
                print(shape_line(shape, args, ranks), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()  # (no rank tears its connections down while a peer still uses them)
    finally:
        dist.destroy_process_group()


# ---- --summarize: the efficiency table from the JSON lines of any number of runs ----------------------------
def read_records(paths):
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def _exchange(record) -> str:
    return record.get("exchange", "ring")  # (records from before the channel exchange existed)


def _slowest(records, kind, shape, world, direction, exchange=None, field="median_ms"):
    """The slowest rank's value and how many ranks recorded one (exchange None: of any exchange)."""
    values = [r[field] for r in records if r["kind"] == kind and r["shape"] == shape and r["world"] == world
              and r["direction"] == direction and exchange in (None, _exchange(r)) and r.get(field) is not None]
    return (max(values), len(values)) if values else (None, 0)


def _baseline(records, kind, shape, direction):
    """P = 1's time of this shape (the faster exchange's where both ran), or ("~", time) scaled by N³ from the
    largest N that ran at P = 1."""
    times = [_slowest(records, kind, shape, 1, direction, exchange)[0] for exchange in ti.SHARD_EXCHANGES]
    if any(t is not None for t in times):
        return min(t for t in times if t is not None), ""
    ran = [r for r in records if r["kind"] == kind and r["world"] == 1 and r["direction"] == direction
           and r["shape"][0] == shape[0] and r["shape"][2:] == shape[2:]]
    if not ran:
        return None, ""
    largest = max(ran, key=lambda r: r["shape"][1])["shape"]
    fastest = min(r["median_ms"] for r in ran if r["shape"] == largest)
    return fastest * (shape[1] / largest[1]) ** 3, "~"


def _format(value, spec, missing="—"):
    return missing if value is None else format(value, spec)


def summarize(paths, fused: dict) -> str:
    from shard_model import EGRESS, predict, predict_channels  # (bench/ is on the path: this file's folder)
    records = read_records(paths)
    rows = ["| direction | exchange | B,N,C,H | P | ranks | forward ms | eff. vs P=1 | eff. vs fused | predicted ms "
            "(eff.) | step ms | step eff. vs P=1 | hidden | MB sent fwd / bwd per rank | peak GiB per rank (fwd / "
            "step) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["direction"], _exchange(r), tuple(r["shape"]), r["world"]) for r in records
                   if r["kind"] == "forward"}, key=lambda k: (k[0], k[2][1], k[3], k[1]))
    for direction, exchange, shape, world in keys:
        shape = list(shape)
        forward, count = _slowest(records, "forward", shape, world, direction, exchange)
        base, approx = _baseline(records, "forward", shape, direction)
        step, _ = _slowest(records, "training_step", shape, world, direction, exchange)
        step_base, step_approx = _baseline(records, "training_step", shape, direction)
        parts = [r for r in records if r["kind"] == "contraction_parts" and r["shape"] == shape
                 and r["world"] == world and r["direction"] == direction and _exchange(r) == exchange]
        hidden = min((r["hidden_share"] for r in parts if r.get("hidden_share") is not None), default=None)
        sent = max((r["bytes_forward"] for r in parts), default=None)
        sent_back = max((r["bytes_backward"] for r in parts), default=None)
        peak, _ = _slowest(records, "forward", shape, world, direction, exchange, "peak_mib")
        step_peak, _ = _slowest(records, "training_step", shape, world, direction, exchange, "peak_mib")
        n = shape[1]
        fused_ms = fused.get(n)
        predicted = None
        if world > 1 and shape[0] == 1 and shape[3] == 128 and n in (4096, 8192, 12288, 16384):
            total, *_, outgoing, incoming = predict(n, world, None, EGRESS)
            seconds = predict_channels(n, world, None, EGRESS) if exchange == "channels" else \
                outgoing if direction == "outgoing" else incoming
            predicted = seconds * 1e3, total / world / seconds
        rows.append(
            f"| {direction} | {exchange} | {','.join(map(str, shape))} | {world} | {count}/{world} | "
            f"{_format(forward, '.2f')} | "
            f"{approx}{_format(base / world / forward if base and forward else None, '.2f')} | "
            f"{_format(fused_ms / world / forward if fused_ms and forward else None, '.2f')} | "
            f"{'—' if predicted is None else f'{predicted[0]:.1f} ({predicted[1]:.2f})'} | {_format(step, '.2f')} | "
            f"{step_approx}{_format(step_base / world / step if step_base and step else None, '.2f')} | "
            f"{_format(hidden, '.0%')} | {_format(sent and sent / 1e6, '.0f')} / "
            f"{_format(sent_back and sent_back / 1e6, '.0f')} | {_format(peak and peak / 1024, '.1f')} / "
            f"{_format(step_peak and step_peak / 1024, '.1f')} |")
    links = [r for r in records if r["kind"] == "links"]
    lines = rows
    for world in sorted({r["world"] for r in links}):
        at = [r for r in links if r["world"] == world]
        one = [r["one_way_0_to_1_gbps"] for r in at if r.get("one_way_0_to_1_gbps")]
        ring = [r["ring_per_direction_gbps"] for r in at]
        spread = [r["all_to_all_out_of_gpu_gbps"] for r in at if r.get("all_to_all_out_of_gpu_gbps")]
        lines.append(f"\nP = {world} links: rank 0 -> 1 alone {_format(max(one, default=None), '.1f')} GB/s; ring "
                     f"exchange {min(ring):.1f}-{max(ring):.1f} GB/s per direction per rank; all-to-all "
                     f"{_format(min(spread, default=None), '.1f')} GB/s out of the slowest GPU")
    runs = {(r["world"], r["direction"], _exchange(r), r.get("commit"), r.get("device")) for r in records
            if r["kind"] == "run"}
    lines.append("\nRuns: " + "; ".join(f"P = {w} {d} {x} (commit {c}, {dev})"
                                        for w, d, x, c, dev in sorted(runs, key=str)))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1,4096,128,128"))
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--precision", default="medium")
    parser.add_argument("--gate-input", choices=ti.GATE_INPUTS, default="normalized")
    parser.add_argument("--direction", choices=ti.DIRECTIONS, default="outgoing")
    parser.add_argument("--exchange", choices=ti.SHARD_EXCHANGES, help="default: ti.shard_exchange_for's rule")
    parser.add_argument("--backward", action="store_true", help="also the training step")
    parser.add_argument("--backward-saves", choices=ti.BACKWARD_SAVES,
                        help='the training step\'s ("inputs": the layers recomputed by row steps; default: the rule)')
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    parser.add_argument("--device", default=None, help="default: cuda:<LOCAL_RANK> where CUDA exists, else cpu")
    parser.add_argument("--timeout", type=float, default=120.0, help="the process group's, seconds")
    parser.add_argument("--no-links", dest="links", action="store_false", help="skip the bandwidth measurement")
    parser.add_argument("--commit", help="recorded in the run's line (default: bench.git_commit, -dirty)")
    parser.add_argument("--jsonl", help="append every rank's records here, one JSON line each")
    parser.add_argument("--summarize", nargs="+", metavar="JSONL", help="print the table of these runs and exit")
    parser.add_argument("--fused", default="", help='one-GPU fused forward ms by N for the table: "8192=257,..."')
    args = parser.parse_args(argv)
    if args.summarize:
        fused = {int(k): float(v) for k, v in (item.split("=") for item in args.fused.split(",") if item)}
        print(summarize(args.summarize, fused))
        return
    run(args)


if __name__ == "__main__":
    main()

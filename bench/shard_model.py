"""bench/shard_model.py — the sharded forward's predicted time per rank (DESIGN.md, "Sharded over ranks").

    python bench/shard_model.py [--rate 680] [--egress 360] [--per-position-ns 0.8]

Inputs: the fused one-GPU forward (bf16 in/out, C = H = 128, normalized gate) measured on an H200, 38.4 ms at
N = 4096 and 257 ms at N = 8192, of which its two passes ~47 ms x (N / 8192)^2 and the rest the contraction,
2 N^3 H FLOP (N = 12288 and 16384 at --rate, default 680 TFLOP/s, the contraction's rate at N = 8192). The
sharded path's per-position work: --per-position-ns of GPU time per position, divided by P (default 0.8: the
no-gradient forward's fused row-block passes and z's block copies, 13.4 ms for N = 4096's 16.8M positions on an
H100; the PyTorch layers that run elsewhere measured 10.3).
Links: each GPU's NVLink egress (--egress GB/s, default 360: the all-reduce bus bandwidth measured on these
machines) is shared by the ring's two directions, so a step that sends a block each way takes two blocks'
bytes / egress. Model (outgoing): per-position work / P, then P block products of (N/P) x N x N/P x H each;
blocks of b travel both ways round the ring, the next ones in flight during the products in hand, so a step
costs max(products in hand, its transfers). Incoming adds one all-to-all of a ((P-1)/P of a rank's block),
not overlapped. The channel exchange (`shard_exchange="channels"`): a and b go from this rank's rows to the
rank that owns their hidden channels, each rank contracts its H/P channels over all N rows and sends z's rows
back, in --groups channel groups: group g + 1's a / b arriving and group g - 1's z leaving while group g is
multiplied; each rank sends (P-1)/P of its a, b and z blocks, the same for either direction. Efficiency against
the fused one-GPU forward: (fused / P) / predicted; against P = 1 of the same code: (contraction + per-position
work at P = 1) / P / predicted.
"""
import argparse

MEASURED = {4096: 38.4e-3, 8192: 257e-3}  # fused one-GPU forward, seconds
FUSED_PASSES_8192 = 47e-3  # its input and output passes at N = 8192
HIDDEN, BYTES = 128, 2
EGRESS = 360e9  # bytes/s out of each GPU (the all-reduce bus bandwidth measured on these machines)


def one_gpu(n, rate):
    """(contraction, fused passes) seconds at N."""
    passes = FUSED_PASSES_8192 * (n / 8192) ** 2
    if rate is None and n in MEASURED:
        return MEASURED[n] - passes, passes
    return 2 * n ** 3 * HIDDEN / (rate or 680e12), passes


def predict(n, p, rate, egress, per_position_ns=0.8):
    """(fused one-GPU s, sharded P = 1 s, block product s, a step's transfers s, outgoing s, incoming s) per rank."""
    contraction, passes = one_gpu(n, rate)
    per_position = per_position_ns * 1e-9 * n * n
    product = contraction / p ** 2  # one block's products
    block = (n / p) * n * HIDDEN * BYTES
    directions = 2 if p > 2 else 1
    transfer = directions * block / egress  # (both ways at once share the GPU's egress)
    steps = p // 2 + 1
    exposed = sum(max(0.0, transfer - (product if d == 0 else directions * product)) for d in range(steps - 1))
    outgoing = per_position / p + p * product + exposed
    all_to_all = block * (p - 1) / p / egress
    return contraction + passes, contraction + per_position, product, transfer, outgoing, outgoing + all_to_all


def predict_channels(n, p, rate, egress, per_position_ns=0.8, groups=8):
    """The channel exchange's forward per rank, seconds (either direction): the per-position work / P, the first
    group's a / b exchange, then per group the larger of its products and the next group's a / b plus the last
    group's z in flight (sharing the GPU's egress), then the last group's z."""
    contraction, _ = one_gpu(n, rate)
    per_position = per_position_ns * 1e-9 * n * n
    moved = (n / p) * n * HIDDEN * BYTES * (p - 1) / p / egress  # one operand's block, (P-1)/P of it sent
    product, arrive, leave = contraction / p / groups, 2 * moved / groups, moved / groups
    steps = sum(max(product, (arrive if g + 1 < groups else 0.0) + (leave if g else 0.0)) for g in range(groups))
    return per_position / p + arrive + steps + leave


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, help="contraction TFLOP/s (default: the measured times)")
    parser.add_argument("--egress", type=float, default=EGRESS / 1e9, help="GB/s out of each GPU, all directions")
    parser.add_argument("--per-position-ns", type=float, default=0.8, help="the sharded layers' ns per position")
    parser.add_argument("--groups", type=int, default=8,
                        help="the channel exchange's channel groups per rank (SHARD_CHANNEL_GROUPS)")
    args = parser.parse_args()
    rate = args.rate * 1e12 if args.rate else None
    print("| N | P | fused one GPU ms | sharded P=1 ms | block product ms | step transfers ms | ring outgoing ms "
          "(eff. vs fused / vs P=1) | ring incoming ms (eff. vs fused / vs P=1) | channels ms (eff. vs fused / vs "
          "P=1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (4096, 8192, 12288, 16384):
        for p in (2, 4, 8):
            fused, single, product, transfer, outgoing, incoming = predict(n, p, rate, args.egress * 1e9,
                                                                           args.per_position_ns)
            channels = predict_channels(n, p, rate, args.egress * 1e9, args.per_position_ns, args.groups)
            print(f"| {n} | {p} | {fused * 1e3:.1f} | {single * 1e3:.1f} | {product * 1e3:.2f} | "
                  f"{transfer * 1e3:.2f} | {outgoing * 1e3:.1f} ({fused / p / outgoing:.2f} / "
                  f"{single / p / outgoing:.2f}) | {incoming * 1e3:.1f} ({fused / p / incoming:.2f} / "
                  f"{single / p / incoming:.2f}) | {channels * 1e3:.1f} ({fused / p / channels:.2f} / "
                  f"{single / p / channels:.2f}) |")


if __name__ == "__main__":
    main()

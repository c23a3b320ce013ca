"""bench/shard_model.py — the sharded forward's predicted time per rank (DESIGN.md, "Sharded over ranks").

    python bench/shard_model.py [--rate 700] [--bandwidth 450]

Inputs: one-GPU forward times (bf16 in/out, C = H = 128) measured on an H200, 39 ms at N = 4096 and 363 ms at
N = 8192 (issue 25's measurements); their per-position part taken as 11 ms x (N / 8192)^2 (the passes at
N = 8192), the rest the contraction, 2 N^3 H FLOP; N = 16384 extrapolated at 450 TFLOP/s. --rate replaces the
contraction's rate (TFLOP/s) at every N. Link bandwidth per direction (GB/s): NVLink on H200 systems, ~450.
Model (outgoing): per-position work / P, then P block products of (N/P) x N x N/P x H each; blocks of b
((N/P) x N x H bf16) travel both ways round the ring, the next ones in flight during the products in hand, so a
step costs max(products in hand, one block's transfer). Incoming adds one all-to-all of a ((P-1)/P of a rank's
block), not overlapped. Efficiency: (one-GPU time / P) / predicted time.
"""
import argparse

MEASURED = {4096: 39e-3, 8192: 363e-3}  # one-GPU forward, seconds
HIDDEN, BYTES = 128, 2


def one_gpu(n, rate):
    per_position = 11e-3 * (n / 8192) ** 2
    flops = 2 * n ** 3 * HIDDEN
    if rate is None and n in MEASURED:
        return MEASURED[n] - per_position, per_position
    return flops / (rate or 450e12), per_position


def predict(n, p, rate, bandwidth):
    contraction, per_position = one_gpu(n, rate)
    product = contraction / p ** 2  # one block's products
    transfer = (n / p) * n * HIDDEN * BYTES / bandwidth
    steps = p // 2 + 1
    exposed = sum(max(0.0, transfer - (product if d == 0 else 2 * product)) for d in range(steps - 1))
    outgoing = per_position / p + p * product + exposed
    all_to_all = (n / p) * n * HIDDEN * BYTES * (p - 1) / p / bandwidth
    total = contraction + per_position
    return total, product, transfer, outgoing, outgoing + all_to_all


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, help="contraction TFLOP/s (default: the measured times)")
    parser.add_argument("--bandwidth", type=float, default=450.0, help="GB/s per link direction")
    args = parser.parse_args()
    rate = args.rate * 1e12 if args.rate else None
    print("| N | P | one GPU ms | block product ms | block transfer ms | outgoing ms (eff) | incoming ms (eff) |")
    print("|---|---|---|---|---|---|---|")
    for n in (4096, 8192, 16384):
        for p in (2, 4, 8):
            total, product, transfer, outgoing, incoming = predict(n, p, rate, args.bandwidth * 1e9)
            print(f"| {n} | {p} | {total * 1e3:.1f} | {product * 1e3:.2f} | {transfer * 1e3:.2f} | "
                  f"{outgoing * 1e3:.1f} ({total / p / outgoing:.2f}) | {incoming * 1e3:.1f} ({total / p / incoming:.2f}) |")


if __name__ == "__main__":
    main()

"""d_proj_d_pair's d pair against fp64, per tile round: which of a warpgroup's tiles go wrong.

    python dev/d_pair_tiles.py --n 512 [--batch 1] [--hidden 128] [--pair-dtype float32] [--incoming]

The pass (input_backward wgmma_rs, BackwardPass d_proj_d_pair) runs on random x_hat, rstd, weights, da/db
planes, d gate and mask, as test_d_proj_d_pair_matches_fp64 builds them; the reference is LayerNorm_in's
backward of d x_hat = d proj W_in_f + d gate W_gate_f in fp64 on the GPU, on the pass's own d proj; d proj
itself against fp64 from x_hat, the weights and da/db (so a wrong d proj, which d pair's check cannot see, shows
too). Rows are grouped by the tile that holds them and by the round in
which the grid's warpgroups take that tile (tile // warpgroups: 0 for each warpgroup's first tile), so an error
that appears only from a warpgroup's second tile on shows up as round 0 clean and the later rounds not. Also
prints the worst rows. --blocks: the pass's grid (default: one block per SM, persistent_sum_blocks; 512 for
trees before it); --bool-mask: a bool mask (the models' and bench.py's) instead of a float one.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402

POSITIONS_PER_TILE = 64       # (proj_rs's tile: 64 positions per warpgroup)
GROUPS = 2                    # (warpgroups per block when the pass writes d pair)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--pair-dtype", default="float32")
    parser.add_argument("--incoming", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--bool-mask", action="store_true")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    batch, n, hidden, pair_dim, eps = args.batch, args.n, args.hidden, 128, 1e-5
    positions = batch * n * n
    pair_dtype = getattr(torch, args.pair_dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    x_hat = randn(positions, pair_dim).bfloat16()
    rstd = torch.exp(randn(positions))
    w_in_f = randn(4 * hidden, pair_dim) / pair_dim ** 0.5
    b_in_f = 0.3 * randn(4 * hidden)
    da, db = randn(batch * hidden, n, n).bfloat16(), randn(batch * hidden, n, n).bfloat16()
    d_gate = randn(positions, pair_dim).bfloat16()
    w_gate_f = randn(pair_dim, pair_dim) / pair_dim ** 0.5
    mask_rows = torch.rand(positions, generator=g, device="cuda") > 0.2
    if not args.bool_mask:
        mask_rows = mask_rows.float()
    pair_rows = torch.empty(positions, pair_dim, device="cuda", dtype=pair_dtype)
    like = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    fused = ti._KernelBackwardPasses("input_backward", "wgmma_rs", batch, n, pair_dim, hidden, args.incoming, 2, like)
    if not fused.d_pair_in_d_proj():
        sys.exit(f"the pass does not take N = {n} (N^2 a multiple of 8, H a multiple of 32 up to 128)")
    d_proj, _, _, d_pair = fused.d_proj_d_pair(x_hat, rstd, eps, w_in_f, b_in_f, da, db, mask_rows, False, d_gate,
                                               w_gate_f, pair_rows)
    torch.cuda.synchronize()
    x = x_hat.double()
    d = d_proj.double() @ w_in_f.bfloat16().double() + d_gate.double() @ w_gate_f.bfloat16().double()
    expected = rstd.double()[:, None] * (d - d.mean(1, keepdim=True) - x * (d * x).mean(1, keepdim=True))
    row_error, total = relative_errors(d_pair, expected)
    print(f"N = {n}, batch {batch}, H {hidden}, pair {args.pair_dtype}, {'incoming' if args.incoming else 'outgoing'}:"
          f" d pair error {total:.2e} over {positions} rows")

    # Row r of the plane order is position r outgoing; incoming, plane element p = f n + k is position (k n + f).
    plane = torch.arange(positions, device="cuda")
    if args.incoming:
        b, rest = plane // (n * n), plane % (n * n)
        f, k = rest // n, rest % n
        position = (b * n + k) * n + f
    else:
        position = plane
    tiles_per_batch = (n * n + POSITIONS_PER_TILE - 1) // POSITIONS_PER_TILE
    tile = (plane // (n * n)) * tiles_per_batch + (plane % (n * n)) // POSITIONS_PER_TILE
    blocks = args.blocks or min(512, torch.cuda.get_device_properties(0).multi_processor_count)
    rounds = tile // (GROUPS * blocks)
    report("d pair", row_error[position], rounds, tile)

    # d proj in fp64 from the pass's inputs (bf16 x_hat and weights, as the pass multiplies them).
    proj = x_hat.double() @ w_in_f.bfloat16().double().t() + b_in_f.double()
    pa, ga, pb, gb = proj.split(hidden, dim=1)
    m = mask_rows.double()[:, None]
    d_rows = []
    for planes, p, gate in ((da, pa, ga), (db, pb, gb)):
        d = torch.empty(positions, hidden, device="cuda", dtype=torch.float64)
        d[position] = planes.view(batch, hidden, n * n).permute(0, 2, 1).reshape(positions, hidden).double()
        s = torch.sigmoid(gate)
        d_p = d * s * m
        d_rows += [d_p, d_p * p * (1 - s)]
    expected_proj = torch.cat(d_rows, dim=1)
    proj_error, total = relative_errors(d_proj, expected_proj)
    print(f"d proj error {total:.2e}")
    report("d proj", proj_error[position], rounds, tile, masked=mask_rows[position] == 0)


def relative_errors(got, expected):
    """||got - expected|| / ||expected|| per row and over the whole tensor."""
    diff = got.double() - expected
    return diff.norm(dim=1) / expected.norm(dim=1).clamp_min(1e-30), (diff.norm() / expected.norm()).item()


def report(name, err_by_plane, rounds, tile, masked=None):
    """Per tile round: the median and max row error; then the worst rows (rows the mask zeroes, whose expected
    row is zero, left out)."""
    if masked is not None:
        err_by_plane = torch.where(masked, torch.zeros_like(err_by_plane), err_by_plane)
    for r in range(int(rounds.max().item()) + 1):
        sel = err_by_plane[rounds == r]
        print(f"{name} round {r:3d}: {sel.numel():8d} rows, median {sel.median().item():.2e}, max "
              f"{sel.max().item():.2e}, rows over 1e-2: {(sel > 1e-2).sum().item()}")
    worst = torch.topk(err_by_plane, 6)
    for e, i in zip(worst.values.tolist(), worst.indices.tolist()):
        print(f"  plane row {i} (tile {tile[i].item()}, round {rounds[i].item()}, row {i % POSITIONS_PER_TILE} of its"
              f" tile): error {e:.2e}")


if __name__ == "__main__":
    main()

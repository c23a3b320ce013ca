"""The long forward with its input pass split over the hidden channels, the later parts beside the contraction.

The contraction of planes h needs a and b of those channels at every position, so the input pass can be split by
channels (each part a ModelNew of hidden H / parts whose projections are rows of the layer's: the same kernels,
the same products per channel; each part reads the whole pair again) and part p + 1's input pass can run beside
part p's contraction on a high-priority stream. At N = 8192 the contraction is power-bound (~1.4 GHz), so it may
lose little to the SMs the input pass takes (dev/overlap_power_probe.py measures that premise alone). Times the
whole forward's steps, the split steps in sequence and overlapped (median ms of `calls`), and checks that the
split forward's output equals the whole one's. Built from ForwardSteps only: no kernel changes.

    python dev/split_input_probe.py [--n 8192] [--parts 2,4] [--calls 3]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402

_CHANNEL_ROWS = ("proj_a", "gate_a", "proj_b", "gate_b")  # (Linears whose output rows are hidden channels)


def median_ms(fn, calls: int) -> float:
    """bench.py's timing (warm-up, CUDA events, median) in ms, at least `calls` timed calls."""
    return bench.time_cuda(fn, min_reps=calls, budget_s=0.0)[0] / 1e3


def channel_part(model: ti.ModelNew, first: int, count: int) -> ti.ModelNew:
    """A ModelNew whose input side computes channels [first, first + count) of `model`'s a and b (its output
    side is unused)."""
    part = ti.ModelNew(model.pair_dim, count, gate_input=model.gate_input).cuda()
    with torch.no_grad():
        part.layer_norm_in.load_state_dict(model.layer_norm_in.state_dict())
        for name in _CHANNEL_ROWS:
            getattr(part, name).weight.copy_(getattr(model, name).weight[first:first + count])
            getattr(part, name).bias.copy_(getattr(model, name).bias[first:first + count])
    return part


def row_blocks(args, whole, ab, z, out, expected, side) -> None:
    """The whole input pass, then z by row blocks (cuBLAS on the planes' rows) with each finished block's output
    pass on the high-priority stream beside the next block's product."""
    n, blocks = args.n, args.row_blocks
    rows = -(-n // blocks)
    ranges = [(r * rows, min(n, (r + 1) * rows)) for r in range(blocks)]
    a_t, b_t = ab[0][:, :, :n], ab[1][:, :, :n]

    def block(r0, r1):
        torch.bmm(a_t[:, r0:r1], b_t.transpose(1, 2), out=z[:, r0:r1, :n])

    def in_sequence():
        whole.input_pass(ab)
        for r0, r1 in ranges:
            block(r0, r1)
        for r0, r1 in ranges:
            whole.output_pass(out, z=z, rows=(r0, r1))

    def overlapped():
        main = torch.cuda.current_stream()
        whole.input_pass(ab)
        side.wait_stream(main)
        for r0, r1 in ranges:
            block(r0, r1)
            done = torch.cuda.Event()
            done.record(main)
            side.wait_event(done)
            with torch.cuda.stream(side):
                whole.output_pass(out, z=z, rows=(r0, r1))
        main.wait_stream(side)

    for name, fn in (("row blocks, in sequence", in_sequence), ("row blocks, output beside", overlapped)):
        out.fill_(float("nan"))
        ms = median_ms(fn, args.calls)
        error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        print(f"{blocks} {name:30s} {ms:8.1f} ms (output vs the whole forward's: {error:.1e})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--parts", default="2,4")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--row-blocks", type=int, default=0,
                        help="also z by this many row blocks (cuBLAS), each block's output pass beside the next "
                             "block's product (needs ForwardSteps.output_pass(rows=...): dev/output_row_ranges.diff)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ti.ModelNew(128, 128, gate_input="normalized").cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    pair = torch.randn(1, args.n, args.n, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(1, args.n, args.n, device="cuda") > 0.05
    whole = model.forward_steps(pair, mask)
    print({role: whole.plan[role] for role in ti.FORWARD_ROLES}, flush=True)
    z, out = whole.new_z(), whole.new_out()
    ab = whole.new_ab()

    def forward():
        whole.input_pass(ab)
        whole.contraction(ab, z)
        whole.output_pass(out, z=z, ab=ab)

    times = {"whole forward": median_ms(forward, args.calls),
             "whole input pass": median_ms(lambda: whole.input_pass(ab), args.calls),
             "whole contraction": median_ms(lambda: whole.contraction(ab, z), args.calls),
             "whole output pass": median_ms(lambda: whole.output_pass(out, z=z, ab=ab), args.calls)}
    for name, ms in times.items():
        print(f"{name:34s} {ms:8.1f} ms", flush=True)
    forward()
    expected = out.clone()
    side = torch.cuda.Stream(priority=-1)
    if args.row_blocks:
        row_blocks(args, whole, ab, z, out, expected, side)
    del ab
    torch.cuda.empty_cache()

    for parts in (int(p) for p in args.parts.split(",")):
        count = model.hidden_dim // parts
        steps = [channel_part(model, p * count, count).forward_steps(pair, mask) for p in range(parts)]
        abs_ = [s.new_ab() for s in steps]
        zs = [z[p * count:(p + 1) * count] for p in range(parts)]  # (B = 1: channel p's planes are z[p])
        assert all(tuple(s.plan["z_shape"]) == tuple(zp.shape) for s, zp in zip(steps, zs))

        def in_sequence():
            for s, ab_p, z_p in zip(steps, abs_, zs):
                s.input_pass(ab_p)
                s.contraction(ab_p, z_p)
            whole.output_pass(out, z=z)

        def overlapped():
            main = torch.cuda.current_stream()
            steps[0].input_pass(abs_[0])
            side.wait_stream(main)
            ready = []
            with torch.cuda.stream(side):
                for s, ab_p in zip(steps[1:], abs_[1:]):
                    s.input_pass(ab_p)
                    ready.append(torch.cuda.Event())
                    ready[-1].record(side)
            for p, (s, ab_p, z_p) in enumerate(zip(steps, abs_, zs)):
                if p:
                    main.wait_event(ready[p - 1])
                s.contraction(ab_p, z_p)
            whole.output_pass(out, z=z)

        for name, fn in (("in sequence", in_sequence), ("overlapped", overlapped)):
            out.fill_(float("nan"))
            ms = median_ms(fn, args.calls)
            error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
            print(f"{parts} parts, {name:22s} {ms:8.1f} ms (output vs the whole forward's: {error:.1e})", flush=True)
        part_input = median_ms(lambda: steps[0].input_pass(abs_[0]), args.calls)
        print(f"{parts} parts, one part's input pass {part_input:8.1f} ms", flush=True)
        del steps, abs_
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

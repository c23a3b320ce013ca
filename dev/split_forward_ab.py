"""The split forward (trimul_inline._split_forward) against the one fused call at large N: the same layer and
inputs, the fused call as it runs, then with the free memory the rule reads set below the fused peak so that
forward() takes the split (bf16 pair, B = 1: two channel groups). Median ms (bench.time_cuda), peak MiB above
the inputs, the split's output against the fused one's.

    python dev/split_forward_ab.py [--n 8192] [--free-gib 40]
    python dev/split_forward_ab.py --n 10240 --real     # (an 80 GB card: the fused call does not fit)

--real: no told free memory: forward() as it runs (which path it takes, its time and peak), then
forward_chunked() alone; no output comparison (the fused output would not fit beside them).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402


def relative_error(out: torch.Tensor, ref: torch.Tensor, rows: int = 256) -> float:
    """||out - ref|| / ||ref|| in fp32, a block of rows at a time (the whole pair in fp32 would not fit)."""
    num = den = 0.0
    for r in range(0, out.shape[1], rows):
        o, e = out[:, r:r + rows].float(), ref[:, r:r + rows].float()
        num += (o - e).square().sum().item()
        den += e.square().sum().item()
    return (num / den) ** 0.5


def real_memory(args, model, pair, mask, taken) -> None:
    """forward() with the card's real free memory, then the chunked forward, each timed and its peak counted."""
    chunked, chunked_update = [], ti._chunked_update
    ti._chunked_update = lambda *a: chunked.append(1) or chunked_update(*a)
    rows = []
    with torch.inference_mode():
        for name, fn in (("forward()", lambda: model(pair, mask)),
                         ("forward_chunked()", lambda: model.forward_chunked(pair, mask))):
            taken.clear(), chunked.clear()
            timing = bench.time_cuda(fn, min_reps=3, budget_s=0.0)[:3]
            path = f"split ({taken[0]} groups)" if taken else "chunked" if chunked else "fused"
            rows.append((f"{name} [{path}]", timing, bench.peak_memory_mib(fn)))
            torch.cuda.empty_cache()
    for name, (median, p10, p90), peak in rows:
        print(f"N={args.n} {args.gate_input} {name:34s} {median / 1e3:8.1f} ms (p10-p90 {p10 / 1e3:.1f}-"
              f"{p90 / 1e3:.1f}) peak {peak:8.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--free-gib", type=float, default=40.0)
    parser.add_argument("--gate-input", default="normalized")
    parser.add_argument("--real", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ti.ModelNew(128, 128, gate_input=args.gate_input).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    pair = torch.randn(1, args.n, args.n, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(1, args.n, args.n, device="cuda") > 0.05
    taken, run_split = [], ti._run_split
    ti._run_split = lambda *a: taken.append(len(a[-1])) or run_split(*a)
    if args.real:
        return real_memory(args, model, pair, mask, taken)
    with torch.inference_mode():
        forward = lambda: model(pair, mask)  # noqa: E731
        fused = (bench.time_cuda(forward, min_reps=3, budget_s=0.0)[:3], bench.peak_memory_mib(forward))
        expected = forward()  # (held from here: the input, it and the split's 32 GiB fit an 80 GB card)
        assert not taken
        ti._free_bytes = lambda device: int(args.free_gib * (1 << 30))
        out = forward()
        error = relative_error(out, expected)
        del out
        torch.cuda.empty_cache()
        split = (bench.time_cuda(forward, min_reps=3, budget_s=0.0)[:3], bench.peak_memory_mib(forward))
    for name, ((median, p10, p90), peak) in (("fused", fused), (f"split ({taken[0]} groups)", split)):
        print(f"N={args.n} {args.gate_input} {name:18s} {median / 1e3:8.1f} ms (p10-p90 {p10 / 1e3:.1f}-"
              f"{p90 / 1e3:.1f}) peak {peak:8.0f} MiB", flush=True)
    print(f"split vs fused output: {error:.1e}", flush=True)


if __name__ == "__main__":
    main()

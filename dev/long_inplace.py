"""Issue 25's long-sequence target: the chunked forward and the in-place update (update_) at N = 12288, bf16 pair
and parameters, C = H = 128, gate on the normalized input: time per call (CUDA events) and peak memory above the
inputs, as a multiple of the pair's bytes, each checked on sampled output rows against float64
(bench.fp64_output_rows at the same bf16 inputs and parameters).

    python dev/long_inplace.py [--n 12288] [--repeats 2] [--direction outgoing] [--json OUT] [--profile]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402


def timed(call, repeats):
    """(median ms over `repeats` calls after one warm-up, peak bytes any call allocated above the start)."""
    times = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for index in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        if index:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=12288)
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--direction", default="outgoing", choices=ti.DIRECTIONS)
    parser.add_argument("--json")
    parser.add_argument("--profile", action="store_true",
                        help="after the timings, the top CUDA ops of one update_ per lean setting (torch.profiler)")
    args = parser.parse_args()
    n, c = args.n, args.channels
    generator = torch.Generator(device="cuda").manual_seed(0)
    ref = bench.randomize(ti.Model(c, c, args.direction, "normalized").cuda(), generator)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()})
    model = ti.ModelNew(c, c, args.direction, "normalized").cuda()
    model.load_state_dict(ref.state_dict())
    model = model.to(torch.bfloat16).requires_grad_(False)
    pair = torch.randn(1, n, n, c, generator=generator, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(1, n, n, generator=generator, device="cuda") > 0.1
    mask[:, n // 3] = False
    pair_bytes = pair.numel() * pair.element_size()
    rows = torch.linspace(0, n - 1, 8).long()
    results = {"n": n, "channels": c, "direction": args.direction, "pair_gib": pair_bytes / 2**30,
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    whole_bytes = pair.shape[0] * c * n * n * pair.element_size()  # (the whole side's planes: bf16, H = C)
    plan = ti._chunk_plan(pair, c, pair.dtype, whole_bytes, None)
    results["plan"] = plan._asdict()
    print(f"chunk plan (before the whole side is allocated, so the free-memory cap may differ): {plan}", flush=True)
    in_place = ti._in_place_plan(pair, c, pair.dtype, None)
    results["in_place_plan"] = in_place._asdict()
    print(f"in-place plan: {in_place}", flush=True)
    with torch.no_grad():
        expected = bench.fp64_output_rows(ref, pair, mask, rows)
        before = pair[:, rows].clone()
        out = torch.empty_like(pair)
        ms, peak = timed(lambda: model.forward_chunked(pair, mask, out=out), args.repeats)
        error = bench.relative_error(out[:, rows], expected)
        results["forward_chunked"] = {"ms": ms, "peak_gib": peak / 2**30, "peak_x_pair": peak / pair_bytes,
                                      "rel_err_sampled_rows": error, "note": "out preallocated (not counted)"}
        print(f"forward_chunked(out=): {ms:.0f} ms, peak above inputs and out {peak / 2**30:.1f} GiB "
              f"({peak / pair_bytes:.2f}x the pair), rel err {error:.1e} on {len(rows)} rows", flush=True)
        update = out[:, rows].clone()
        del out
        torch.cuda.empty_cache()
        for lean in (True, False):  # (the lean one checked first, on the untouched pair; the other is session
            model.update_(pair, mask, lean=lean)  # 18's path, whose check the updated pair no longer allows)
            in_place_error = bench.relative_error(pair[:, rows], before.double() + expected) if lean else float("nan")
            in_place_vs_forward = bench.relative_error(pair[:, rows], before + update) if lean else float("nan")
            ms, peak = timed(lambda: model.update_(pair, mask, lean=lean), args.repeats)
            results[f"update_lean_{lean}"] = {
                "ms": ms, "peak_gib": peak / 2**30, "peak_x_pair": peak / pair_bytes,
                "rel_err_sampled_rows_vs_pair_plus_fp64": in_place_error,
                "rel_diff_vs_pair_plus_forward_chunked": in_place_vs_forward}
            print(f"update_(lean={lean}) (in place): {ms:.0f} ms, peak above inputs {peak / 2**30:.2f} GiB "
                  f"({peak / pair_bytes:.3f}x the pair's {pair_bytes / 2**30:.1f} GiB); sampled rows vs pair + fp64 "
                  f"update {in_place_error:.1e}, vs pair + forward_chunked's {in_place_vs_forward:.1e}", flush=True)
        if args.profile:
            for lean in (True, False):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    model.update_(pair, mask, lean=lean)
                    torch.cuda.synchronize()
                print(f"update_(lean={lean}) by CUDA op:\n"
                      f"{prof.key_averages().table(sort_by='cuda_time_total', row_limit=15, max_name_column_width=70)}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

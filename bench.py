"""bench.py — check every contender against an fp64 reference, then time it.

    python bench.py                                   # default shapes, every contender
    python bench.py --shapes 1,256,128,128 --kernels tiled --precision high --json out.json
    python bench.py --profile --kernels input=wgmma_rs,input=wgmma_ws   # A/B two kernels in one process
    python bench.py --backward --precision highest,high,medium --json train.json   # training steps

For each shape (B, N, C, H) each contender is first checked against the reference model run in
float64 (relative error ||out - ref|| / ||ref||; over 4M positions, where the whole reference in float64
would not fit, on 8 output rows computed in float64 chunk by chunk); a contender over its tolerance
prints FAIL and is not timed. Timing: CUDA events around each forward call, after warm-up, median of many calls with
the 10th-90th percentile spread, and the peak memory the call allocated beyond what was already
allocated. Without CUDA it says so and runs a small CPU comparison.

--backward times one training step per call instead (gradients set to None, forward, loss = mean of
out² in fp32, backward), after checking each contender's gradients (d pair_repr and every parameter's)
against the reference's in float64 (per-tensor relative errors, 16-bit contenders' at their rounded inputs
and parameters; over tolerance: FAIL, not timed; over 4M
positions, per tensor along its own direction against central differences of the float64 chunked
forward, DirectionalReference, which flags wrong gradients but does not measure precision); peak
memory is counted above the inputs and parameters, the previous step's gradients released. Its gate
input defaults to "normalized" (cuEquivariance's). Without CUDA it checks ModelNew's gradients on CPU.
"""
import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch

import trimul_inline as ti

DEFAULT_SHAPES = [(1, 32, 64, 32), (16, 32, 64, 32), (2, 256, 128, 128), (1, 512, 128, 128),
                  (1, 768, 128, 128), (1, 1024, 128, 128), (2, 256, 384, 128), (1, 768, 384, 128),
                  (1, 1024, 384, 128)]
# The geomean row covers the seven shapes large enough not to be launch-bound (issue 3's table).
GEOMEAN_SHAPES = DEFAULT_SHAPES[2:]
TOLERANCE = {"highest": 1e-5, "high": 2e-3, "medium": 1e-2, "bfloat16": 2e-2}
# --backward: (d pair_repr, each parameter's gradient) relative errors against fp64.
GRAD_TOLERANCE = {"highest": (1e-5, 1e-5), "high": (2e-3, 2e-3), "medium": (1e-2, 3e-2),
                  "bfloat16": (1e-2, 3e-2)}
CPU_BACKWARD_SHAPES = [(1, 7, 16, 8), (2, 9, 12, 20)]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_shapes(text: str):
    shapes = []
    for item in text.replace(" ", "").split(";"):
        parts = [int(p) for p in item.split(",") if p]
        if len(parts) != 4:
            raise SystemExit(f"--shapes: each shape is B,N,C,H; got {item!r}")
        shapes.append(tuple(parts))
    return shapes


def model_flops(batch, n, pair_dim, hidden) -> float:
    """Useful FLOPs of one forward: the five input projections, the contraction, out_proj."""
    pairs = batch * n * n
    return 2.0 * pairs * (pair_dim * 4 * hidden + pair_dim * pair_dim + hidden * pair_dim) \
        + 2.0 * batch * hidden * n ** 3


def kernel_work(kernel_name, batch, n, pair_dim, hidden, precision):
    """(useful FLOPs, fewest bytes) of one of ModelNew's kernels, from its profiler name; None for
    others. Bytes: fp32 pair rows, bool mask, fp32 z and output, and the a/b operands at the size the
    fused input pass writes them with a bool mask (2 bytes each: bf16 or scaled fp16; "highest": an
    fp16 part and remainder, 4). The output pass's FLOPs include an in-pass contraction where it makes
    one (no contraction kernel at small N)."""
    pairs = batch * n * n
    ab_bytes = 2 * batch * hidden * n * n * (4 if precision == "highest" else 2)
    z_bytes = 4 * batch * hidden * n * n
    contraction = 2.0 * batch * hidden * n ** 3
    if "input_pass" in kernel_name:
        return 2.0 * pairs * pair_dim * 4 * hidden, 4 * pairs * pair_dim + pairs + ab_bytes
    if "contract" in kernel_name:
        return contraction, ab_bytes + z_bytes
    if "output_pass" in kernel_name:
        flops = 2.0 * pairs * (pair_dim * pair_dim + hidden * pair_dim)
        return flops, 8 * pairs * pair_dim + z_bytes
    return None


def make_inputs(batch, n, pair_dim, generator, device):
    pair = torch.randn(batch, n, n, pair_dim, generator=generator, device=device)
    mask = torch.rand(batch, n, n, generator=generator, device=device) > 0.1
    mask[:, n // 3, :] = False  # a masked-out row, as padded residues give
    return pair, mask


def randomize(model, generator):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, device=p.device) * 0.3)
        model.layer_norm_in.weight.add_(1.0)
        model.layer_norm_out.weight.add_(1.0)
    return model


class Contender:
    """`group`: contenders of one kernel choice at several precisions, of which a shape times only the
    first whose call the choice takes (None: each is timed)."""

    def __init__(self, name, make, tolerance_key, group=None):
        self.name, self.make, self.tolerance_key, self.group = name, make, tolerance_key, group


def cuequivariance():
    try:
        import cuequivariance_torch
    except Exception:  # not installed, or its CUDA ops do not load here
        return None
    return cuequivariance_torch


# cuEquivariance's weight arguments -> the Model parameters they hold; two: stacked [first; second] on dim 0.
CUEQ_WEIGHTS = {"norm_in_weight": ("layer_norm_in.weight",), "norm_in_bias": ("layer_norm_in.bias",),
                "p_in_weight": ("proj_a.weight", "proj_b.weight"), "p_in_bias": ("proj_a.bias", "proj_b.bias"),
                "g_in_weight": ("gate_a.weight", "gate_b.weight"), "g_in_bias": ("gate_a.bias", "gate_b.bias"),
                "norm_out_weight": ("layer_norm_out.weight",), "norm_out_bias": ("layer_norm_out.bias",),
                "p_out_weight": ("out_proj.weight",), "p_out_bias": ("out_proj.bias",),
                "g_out_weight": ("out_gate.weight",), "g_out_bias": ("out_gate.bias",)}


def cueq_weights(ref, dtype):
    """cuEquivariance's weight arguments (CUEQ_WEIGHTS) from the reference's parameters: detached
    copies in `dtype`."""
    params = dict(ref.named_parameters())
    return {arg: torch.cat([params[name] for name in names]).detach().to(dtype).contiguous()
            for arg, names in CUEQ_WEIGHTS.items()}


def make_cueq(ref, dtype):
    """cuEquivariance's fused triangle update on the reference's weights. It gates the output with
    the normalized input (AlphaFold2's convention), so it is checked against gate_input='normalized'.
    Inputs are cast to `dtype` once, outside the timed call."""
    cuet = cuequivariance()
    weights = cueq_weights(ref, dtype)
    return cast_once(lambda x, m: cuet.triangle_multiplicative_update(x, direction=ref.direction, mask=m, eps=1e-5,
                                                                     **weights), dtype, dtype)


def cast_once(fn, pair_dtype, mask_dtype):
    """fn(pair, mask) on the inputs cast to these dtypes, the casts done once per input (outside the
    timed calls that follow the first)."""
    converted = {}

    def run(pair, mask):
        key = (pair.data_ptr(), mask.data_ptr())
        if key not in converted:
            converted.clear()
            wanted = mask_dtype or (mask.dtype if mask.dtype == torch.bool else pair_dtype)
            converted[key] = (pair.to(pair_dtype), mask.to(wanted))
        return fn(*converted[key])
    return run


def parse_kernel_choices(text):
    """--kernels: comma-separated choices, each `auto`, a contraction kernel's name, or role=name with
    further roles joined by '+' (input=wgmma_ws+output=resident); ti.parse_kernels checks the names."""
    choices = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" in item or item == "auto":
            choices.append(ti.parse_kernels(item.replace("+", ","), "--kernels"))
        else:
            choices.append(ti.parse_kernels({"contract": item}, "--kernels"))
    if not choices:
        raise argparse.ArgumentTypeError("--kernels names no kernel")
    return choices


def make_new_bf16_io(ref, kernels=None):
    """ModelNew (the default order, or `kernels`) in bf16, given bf16 inputs (cast once, outside the timed
    calls) and writing bf16: the like-for-like row against cuEquivariance bf16, which reads and writes bf16
    too (the "medium" rows read and write fp32: twice the bytes)."""
    new = make_model_new(ref, kernels).to(torch.bfloat16)
    # (a bool mask stays bool; a float one (--float-mask) as a bf16 model passes it: in the pair's dtype)
    return cast_once(new, torch.bfloat16, None)


def make_model_new(ref, kernels=None, precision=None, gate_input=None):
    """ModelNew with the reference's weights (and biases or none), on the reference's device; another gate
    input where given."""
    new = ti.ModelNew(ref.pair_dim, ref.hidden_dim, ref.direction, gate_input or ref.gate_input, kernels=kernels,
                      precision=precision, bias=ref.proj_a.bias is not None)
    new.load_state_dict(ref.state_dict())
    return new.to(ref.proj_a.weight.device)


def seeded_case(shape, args, seed, device="cuda"):
    """The reference model (random weights) and inputs for one shape, drawn from `seed`."""
    batch, n, pair_dim, hidden = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    ref = randomize(ti.Model(pair_dim, hidden, args.direction, args.gate_input).to(device),
                    generator)
    pair, mask = make_inputs(batch, n, pair_dim, generator, device)
    return ref, pair, mask


DEFAULT_CONTENDERS = "ref-eager,ref-compile,ref-autocast,cueq,new-bf16,new"
FORWARD_CONTENDERS = DEFAULT_CONTENDERS.split(",")


def contenders(args):
    """name -> factory(reference fp32 model) -> callable(pair, mask)."""
    found = []
    if "ref-eager" in args.contenders:
        found.append(Contender("ref eager", lambda ref: ref, "highest"))
    if "ref-compile" in args.contenders:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        found.append(Contender("ref torch.compile", lambda ref: torch.compile(ref), "highest"))
    if "ref-autocast" in args.contenders:
        def autocast(ref):
            def run(pair, mask):
                with torch.autocast("cuda", torch.bfloat16):
                    return ref(pair, mask)
            return run
        found.append(Contender("ref bf16 autocast", autocast, "bfloat16"))
    if "cueq" in args.contenders and cuequivariance() is not None:
        if not args.bf16_inputs:
            found.append(Contender("cueq fp32", lambda ref: make_cueq(ref, torch.float32), "high"))
        found.append(Contender("cueq bf16", lambda ref: make_cueq(ref, torch.bfloat16), "bfloat16"))
    if "new-bf16" in args.contenders:
        # auto, and each choice --kernels named (bf16_kernels: not the default's sweep of every contraction)
        for choice in getattr(args, "bf16_kernels", None) or [ti.Kernels()]:
            found.append(Contender(f"new[{choice}] bf16 in/out", lambda ref, k=choice: make_new_bf16_io(ref, k),
                                   "bfloat16"))
    if "new" in args.contenders:
        # auto at every precision; a named choice at the first precision whose call it takes.
        for precision in args.precision:
            for choice in args.kernels:
                named = choice != ti.Kernels()
                found.append(Contender(f"new[{choice}] {precision}",
                                       lambda ref, k=choice, p=precision: make_model_new(ref, k, p),
                                       precision, group=str(choice) if named else None))
    return found


def warm_up(fn, seconds=0.025, min_calls=2):
    """Calls fn (synchronised) for `seconds` of wall time, at least min_calls times. A seed-shape call
    is ~50 us, mostly host time: two calls left it timed while the host still ran as it had for the
    contender before (the same build's seed rows moved 40-87 us between runs)."""
    start, calls = time.perf_counter(), 0
    while calls < min_calls or time.perf_counter() - start < seconds:
        fn()
        torch.cuda.synchronize()
        calls += 1


def time_cuda(fn, min_reps=10, max_reps=1000, budget_s=0.5):
    """Median and 10th/90th percentile of per-call CUDA event times, in microseconds, after a
    warm-up. Calls slower than 0.1 s (the naive baseline at large N) get 5 repetitions instead of 10."""
    warm_up(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate_s = max(start.elapsed_time(end) / 1e3, 1e-6)
    if estimate_s > 0.1:
        min_reps = 5
    reps = int(min(max_reps, max(min_reps, budget_s / estimate_s)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for begin, finish in events:
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize()
    times = sorted(b.elapsed_time(f) * 1e3 for b, f in events)
    return (statistics.median(times),) + spread(times) + (reps,)


def spread(times):
    """(p10, p90) of sorted times: the nearest ranks round(q (n - 1)), symmetric (10 times: the 2nd and 9th)."""
    return tuple(times[round(q * (len(times) - 1))] for q in (0.1, 0.9))


def settled_reserved_bytes() -> int:
    """Device memory the caching allocator still reserves once unreferenced objects are collected, the device is
    idle and unused cached blocks are released."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def cublas_workspaces_ready() -> None:
    """Make PyTorch allocate its cuBLAS / cuBLASLt workspaces now, for this thread and for autograd's device thread
    (its handles are per thread: fp32 and bf16 GEMMs, with and without a bias, forward and backward). They are
    allocated at a thread's first GEMM and kept for the process: made inside a contender's first step they would
    land in a segment its step freed and keep that whole segment reserved, which held_memory_mib would then
    charge to the contender."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(16, 16, device="cuda", dtype=dtype, requires_grad=True)
        (torch.mm(x, x) + torch.addmm(x[0], x, x)).float().sum().backward()
    torch.cuda.synchronize()


def drop_trimul_graphs() -> None:
    """Frees the CUDA graphs trimul_inline keeps between calls (its small backward's and its weight refreshes')."""
    ti._BACKWARD_GRAPHS.entries.clear()
    ti._WEIGHT_GRAPHS.entries.clear()


def held_memory_start() -> int:
    """Device memory reserved before a contender's first training step, once the backward graphs of earlier
    contenders and their weight refreshes' graphs are dropped (drop_trimul_graphs) and the process's GEMM
    workspaces exist."""
    drop_trimul_graphs()
    cublas_workspaces_ready()
    return settled_reserved_bytes()


def held_memory_mib(reserved_before: int) -> float:
    """Memory a contender still holds after its steps, its model, inputs and gradients released: CUDA graph pools
    and the buffers a graph keeps (a graphed step's intermediates live there, outside the allocations its peak
    counts, so peak + held is what such a step takes); ~0 for a contender that keeps nothing."""
    return max(0.0, (settled_reserved_bytes() - reserved_before) / 2**20)


def peak_memory_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def fp64_model(ref, gate_input=None):
    """The reference in float64 (its weights; another gate input where given), on ref's device."""
    ref64 = ti.Model(ref.pair_dim, ref.hidden_dim, ref.direction, gate_input or ref.gate_input,
                     bias=ref.proj_a.bias is not None)
    ref64 = ref64.to(ref.proj_a.weight.device).double()
    ref64.load_state_dict(ref.state_dict())
    return ref64


def fp64_output(ref, pair, mask, gate_input=None):
    """The reference's output in float64 (its weights; another gate input where given), on ref's device."""
    ref64 = fp64_model(ref, gate_input)
    with torch.inference_mode():
        return ref64(pair.double(), mask)


def fp64_gradients(ref, pair, mask, gate_input=None, rounded_to=None):
    """The reference's gradients of out.square().mean() in float64 (its weights; another gate input
    where given): {"pair_repr": d pair_repr, each parameter's name: its gradient}. rounded_to: the 16-bit
    dtype a contender's pair_repr and parameters were cast to; the reference then differentiates at those
    rounded values, as the tests do, so the error counted is the contender's arithmetic, not the inputs'
    rounding (which alone moves bf16's d pair_repr by ~5e-3, bench/NOTES.md)."""
    ref64 = fp64_model(ref, gate_input)
    pair64 = pair.detach()
    if rounded_to is not None:
        with torch.no_grad():
            for parameter in ref64.parameters():
                parameter.copy_(parameter.to(rounded_to))
        pair64 = pair64.to(rounded_to)
    pair64 = pair64.double().requires_grad_(True)
    ref64(pair64, mask).square().mean().backward()
    return {"pair_repr": pair64.grad, **{name: p.grad for name, p in ref64.named_parameters()}}


# Above this many positions the whole reference in float64 would not fit beside the contenders: the check
# compares SAMPLED_ROWS output rows, computed in float64 chunk by chunk (fp64_output_rows).
SAMPLED_ABOVE = 1 << 22
SAMPLED_ROWS = 8


def long_shape(batch: int, n: int) -> bool:
    """Whether a problem is past SAMPLED_ABOVE positions (checked by sampled rows or by direction)."""
    return batch * n * n > SAMPLED_ABOVE


def sampled_rows(n: int, seed: int) -> torch.Tensor:
    """SAMPLED_ROWS rows of [0, N) to check a long shape's output on: the first, the last, the masked-out one
    (make_inputs' N // 3) and the rest drawn from the run's seed (different tiles each run)."""
    fixed = sorted({0, n - 1, n // 3})
    drawn = [r for r in torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist() if r not in fixed]
    return torch.tensor(sorted(fixed + drawn[:max(0, SAMPLED_ROWS - len(fixed))]))


def fp64_expected(ref, pair, mask, gate_input=None, seed=0):
    """(rows, expected): the reference's whole output in float64 (rows None), or for problems over
    SAMPLED_ABOVE positions that of SAMPLED_ROWS rows (sampled_rows; rows their indices)."""
    batch, n = pair.shape[:2]
    if not long_shape(batch, n):
        return None, fp64_output(ref, pair, mask, gate_input)
    rows = sampled_rows(n, seed)
    return rows, fp64_output_rows(ref, pair, mask, rows, gate_input)


def fp64_output_rows(ref, pair, mask, rows, gate_input=None, chunk=64):
    """The reference's output rows `rows` ([B, len(rows), N, C]) in float64 without the whole problem in
    float64: a and b for `chunk` rows of positions at a time, the contraction of the wanted rows summed
    over the chunks (outgoing: z[i, j] = sum_k a[i, k] b[j, k], b's rows j by chunk; incoming: z[i, j] =
    sum_k a[k, i] b[k, j], the k rows by chunk)."""
    ref64 = fp64_model(ref, gate_input)
    params, eps_in, eps_out = ti._param_list(ref64), ref64.layer_norm_in.eps, ref64.layer_norm_out.eps
    rows = rows.to(pair.device)
    incoming = ref64.direction == "incoming"

    def layers_in(block):  # (x, a, b) of the pair's rows `block`, in float64
        return ti._layers_in(params, pair[:, block].double(), mask[:, block], eps_in, cast_mask=True)

    with torch.inference_mode():
        batch, n = pair.shape[:2]
        z = pair.new_zeros((batch, len(rows), n, ref64.hidden_dim), dtype=torch.float64)
        x_rows, a_rows, _ = layers_in(rows)
        for start in range(0, n, chunk):
            block = slice(start, min(start + chunk, n))
            _, a, b = layers_in(block)
            if incoming:
                z += torch.einsum("bkih,bkjh->bijh", a[:, :, rows], b)
            else:
                z[:, :, block] = torch.einsum("bikh,bjkh->bijh", a_rows, b)
        gate_source = x_rows if ref64.gate_input == "normalized" else pair[:, rows].double()
        return ti._layers_out(params, z, gate_source, eps_out)


def poison_allocator():
    """Fill blocks the caching allocator will hand out next with NaN (up to 256 MiB; larger outputs: each checked
    output is filled with NaN before it is freed), so an output a kernel leaves unwritten shows instead of the
    previous contender's result in a reused block."""
    blocks = [torch.full((1 << p,), float("nan"), device="cuda") for p in range(8, 27)]
    del blocks


def relative_error(out, expected):
    """||out - expected|| / ||expected|| in float64."""
    return ((out.double() - expected).norm() / expected.norm()).item()


def bench_shape(shape, args, index, total):
    ref, pair, mask = seeded_case(shape, args, args.seed + index)
    # cuEquivariance gates with the normalized input, so it needs that reference too.
    gate_inputs = {args.gate_input} | ({"normalized"} if "cueq" in args.contenders else set())
    expected_for = {gate_input: fp64_expected(ref, pair, mask, gate_input, args.seed + index)
                    for gate_input in gate_inputs}
    if args.bf16_inputs:  # (the contenders cast to bf16 anyway: drop the fp32 copy)
        pair = pair.to(torch.bfloat16)
        torch.cuda.empty_cache()
    if args.float_mask:  # (as real models pass it: mask.float(); the reference took the bool)
        mask = mask.to(torch.float32)
    rows = []
    timed_groups = set()
    for contender in contenders(args):
        if contender.group is not None and contender.group in timed_groups:
            continue
        label = f"[{index + 1}/{total}] {shape} {contender.name}"
        row = {"shape": list(shape), "contender": contender.name, "status": "ok"}
        try:
            fn_model = contender.make(ref)
            call = lambda: fn_model(pair, mask)
            with torch.inference_mode():
                poison_allocator()  # (an output left unwritten reads NaN, not the previous contender's result)
                out = call()
                torch.cuda.synchronize()
                checked, expected = expected_for["normalized" if contender.name.startswith("cueq")
                                                 else args.gate_input]
                err = relative_error(out if checked is None else out[:, checked.to(out.device)], expected)
                if checked is not None and not bool(torch.isfinite(out).all()):  # (rows not compared: finite)
                    err = math.nan
                out.fill_(float("nan"))  # (its block, reused by the next call, holds no result)
                del out
                if contender.group is not None:
                    timed_groups.add(contender.group)
                row["rel_error"] = err
                tolerance = TOLERANCE[contender.tolerance_key]
                if not (err <= tolerance):  # NaN fails too
                    row["status"] = "FAIL"
                    log(f"{label}: FAIL, error {err:.2e} > {tolerance:.0e}; not timed")
                    rows.append(row)
                    continue
                log(f"{label}: error {err:.2e} ok; timing")
                median, low, high, reps = time_cuda(call, budget_s=args.budget)
                row.update(median_us=median, p10_us=low, p90_us=high, reps=reps,
                           peak_mib=peak_memory_mib(call))
                row["tflops"] = model_flops(*shape) / (median * 1e-6) / 1e12
        except Exception as error:  # one broken contender must not hide the others
            if isinstance(error, ValueError) and "take this call" in str(error):
                log(f"{label}: the kernels chosen do not take this call; not timed")  # (a named choice: its
                continue                                                            # next precision)
            row["status"] = "ERROR"
            row["error"] = f"{type(error).__name__}: {error}"[:300]
            log(f"{label}: ERROR {row['error']}")
        rows.append(row)
        torch.cuda.empty_cache()
    eager = next((r for r in rows if r["contender"] == "ref eager" and "median_us" in r), None)
    for row in rows:
        if eager and "median_us" in row:
            row["speedup"] = eager["median_us"] / row["median_us"]
    return rows


def print_table(rows, precision):
    header = (f"{'B,N,C,H':<17} {'contender':<26} {'median us':>10} {'p10-p90 us':>17} "
              f"{'vs eager':>8} {'TFLOP/s':>8} {'rel err':>9} {'peak MiB':>9}")
    print(f"\nprecision={precision}  (fp32 inputs; ModelNew follows --precision)")
    print(header)
    print("-" * len(header))
    for row in rows:
        shape = ",".join(str(s) for s in row["shape"])
        err = f"{row['rel_error']:.1e}" if "rel_error" in row else "-"
        if "median_us" not in row:
            print(f"{shape:<17} {row['contender']:<26} {row['status']:>10} {'':>17} {'':>8} "
                  f"{'':>8} {err:>9}")
            continue
        spread = f"{row['p10_us']:.0f}-{row['p90_us']:.0f}"
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
        print(f"{shape:<17} {row['contender']:<26} {row['median_us']:>10.1f} {spread:>17} "
              f"{speedup:>8} {row['tflops']:>8.1f} {err:>9} {row['peak_mib']:>9.0f}")
    geomean_rows = geomeans(rows)
    for name, value in geomean_rows.items():
        print(f"{'geomean (7 large)':<17} {name:<26} {value:>10.1f}")
    return geomean_rows


def geomeans(rows):
    """Geometric mean of medians over GEOMEAN_SHAPES, for contenders timed at all seven."""
    wanted = {tuple(s) for s in GEOMEAN_SHAPES}
    by_contender = {}
    for row in rows:
        if tuple(row["shape"]) in wanted and "median_us" in row:  # (a shape timed twice: its first row)
            by_contender.setdefault(row["contender"], {}).setdefault(tuple(row["shape"]), row["median_us"])
    return {name: math.exp(sum(math.log(t) for t in times.values()) / len(times))
            for name, times in by_contender.items() if set(times) == wanted}


def kernel_times(new, pair, mask, calls=5):
    """{kernel name: CUDA microseconds per forward} over `calls` profiled forwards."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            new(pair, mask)
        torch.cuda.synchronize()
    return {e.key: (e.device_time_total / calls, e.count // calls)
            for e in prof.key_averages() if e.device_type.name == "CUDA"}


def sm_clock_mhz():
    """The GPU's SM clock now (MHz), or None where NVML (pynvml) is not installed."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # (ModuleNotFoundError without pynvml; NVML errors)
        return None


def forward_against_kernels(new, pair, mask, budget_s):
    """The forward as the bench times it (CUDA events around back-to-back calls, time_cuda) and the
    kernels' summed CUDA time right after that sustained run: the forward's time that no kernel
    accounts for (launch gaps, tails) against what a hot GPU does to the kernels themselves."""
    with torch.inference_mode():
        median, low, high, reps = time_cuda(lambda: new(pair, mask), budget_s=budget_s)
        clock = sm_clock_mhz()
        hot = sum(t for t, _ in kernel_times(new, pair, mask).values())
    return {"median": median, "p10": low, "p90": high, "reps": reps, "hot_kernels": hot, "clock": clock}


def profile_kernels(shapes, args, repeat_only=0):
    """Per-kernel CUDA time of ModelNew for each --kernels choice at each precision (torch.profiler), for
    finding where a forward's time goes. With several choices: an A/B in one process (no
    machine-to-machine spread), each choice checked against fp64 first, then profiled twice round (c1 c2
    c1 c2). After the kernels, each choice's forward timed as the table times it (--budget seconds), and
    the kernels' sum again right after that sustained run."""
    rounds = 2 if len(args.kernels) > 1 else 1
    failed = False
    for index, shape in enumerate(shapes):
        ref, pair, mask = seeded_case(shape, args, args.seed + index)  # (the table's inputs for this shape)
        # (long shapes: sampled rows, as the table checks them)
        rows, expected = fp64_expected(ref, pair, mask, seed=args.seed + index) if not repeat_only else (None, None)
        dtype = torch.bfloat16 if args.bf16_inputs else torch.float32
        pair = pair.to(dtype)  # (--bf16-inputs: bf16 pair and parameters, as new-bf16's row)
        for precision in args.precision:
            models = {str(choice): make_model_new(ref, choice, precision).to(dtype) for choice in args.kernels}
            measured = {name: [] for name in models}
            forwards = {name: [] for name in models}
            errors = {}
            for _ in range(rounds):
                for name, new in models.items():
                    with torch.inference_mode():
                        for _ in range(repeat_only or 3):
                            out = new(pair, mask)
                        torch.cuda.synchronize()
                        if expected is not None:
                            errors[name] = relative_error(out if rows is None else out[:, rows.to(out.device)],
                                                          expected)
                        del out
                    if not repeat_only:
                        measured[name].append(kernel_times(new, pair, mask))
                        forwards[name].append(forward_against_kernels(new, pair, mask, args.budget))
            if repeat_only:
                continue
            print(f"\n{shape} {precision}: CUDA time per forward by kernel (TFLOP/s and GB/s from kernel_work's"
                  f" useful FLOPs and fewest bytes)")
            tolerance = TOLERANCE["bfloat16" if args.bf16_inputs else precision]
            for name in models:
                bad = name in errors and not errors[name] <= tolerance  # (NaN too)
                failed |= bad
                error = (f"rel error vs fp64 {errors[name]:.1e}{' FAIL' if bad else ''}; " if name in errors
                         else "")
                print(f"  new[{name}]: {error}mean of {rounds} round(s), total "
                      f"{sum(sum(t[k][0] for k in t) for t in measured[name]) / rounds:.1f} us")
                keys = {k for t in measured[name] for k in t}
                mean = {k: sum(t.get(k, (0, 0))[0] for t in measured[name]) / rounds for k in keys}
                count = {k: max(t.get(k, (0, 0))[1] for t in measured[name]) for k in keys}
                for key in sorted(keys, key=lambda k: -mean[k])[:8]:
                    us = mean[key]
                    work = kernel_work(key, *shape, precision)
                    rates = f"{work[0] / us / 1e6:7.1f} {work[1] / us / 1e3:7.0f}" if work and us > 0 else " " * 15
                    print(f"  {us:10.1f} us  {count[key]:3d}x  {rates}  {key[:90]}")
                for f in forwards[name]:
                    clock = f"; SM clock {f['clock']} MHz" if f["clock"] else ""
                    print(f"  forward (events, {f['reps']} back-to-back calls) {f['median']:.1f} us"
                          f" (p10-p90 {f['p10']:.0f}-{f['p90']:.0f}); kernels' sum right after"
                          f" {f['hot_kernels']:.1f} us{clock}")
    return failed


def cpu_comparison():
    """No GPU: compare Model with ModelNew's CPU fallback on a small shape, by wall clock."""
    print("CUDA is not available: running a small CPU comparison instead (ModelNew falls back to "
          "the reference computation on CPU).")
    shape = (1, 24, 32, 16)
    generator = torch.Generator().manual_seed(0)
    ref = randomize(ti.Model(shape[2], shape[3]), generator)
    new = ti.ModelNew(shape[2], shape[3])
    new.load_state_dict(ref.state_dict())
    pair, mask = make_inputs(shape[0], shape[1], shape[2], generator, "cpu")
    expected = fp64_output(ref, pair, mask)
    with torch.inference_mode():
        for name, model in (("ref eager", ref), ("ModelNew (CPU fallback)", new)):
            out = model(pair, mask)
            err = relative_error(out, expected)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                model(pair, mask)
                times.append((time.perf_counter() - t0) * 1e6)
            print(f"{str(shape):<17} {name:<26} {statistics.median(times):>10.1f} us  "
                  f"rel err {err:.1e}")
    return 0


class Trainable(NamedTuple):
    """A contender ready for training steps: forward(pair, mask), the tensors its gradients land on
    (`leaves`) and gradients() -> {Model's parameter name: its gradient}; `checked`: the gradients it makes
    (None: pair_repr's and every parameter's)."""
    forward: Callable
    leaves: list
    gradients: Callable
    checked: Optional[frozenset] = None


class TrainingContender:
    """A --backward contender: make(ref) -> Trainable; inputs in `dtype` (pair_repr) and `mask_dtype`;
    gradients checked with GRAD_TOLERANCE[tolerance_key]. `informational`: over tolerance is reported
    and the row timed anyway."""

    def __init__(self, name, make, tolerance_key, dtype=torch.float32, mask_dtype=torch.bool,
                 informational=False):
        self.name, self.make, self.tolerance_key = name, make, tolerance_key
        self.dtype, self.mask_dtype, self.informational = dtype, mask_dtype, informational


def trainable_module(module, forward=None, autocast=False):
    """Trainable of a module with Model's parameter names: `forward` (default: the module itself), under
    bf16 autocast where asked, training the module's parameters."""
    forward = module if forward is None else forward
    params = dict(module.named_parameters())

    def run(pair, mask):
        with torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext():
            return forward(pair, mask)
    return Trainable(run, list(params.values()), lambda: {name: p.grad for name, p in params.items()})


def frozen_trainable(module):
    """Trainable of a module whose parameters are frozen (requires_grad False: a frozen layer that gradients pass
    through, as in fine-tuning around it or design by gradient): only d pair_repr is made and checked."""
    for p in module.parameters():
        p.requires_grad_(False)
    return Trainable(module, [], lambda: {}, frozenset({"pair_repr"}))


def cueq_gradients(leaves):
    """{Model's parameter name: gradient} from the gradients of cuEquivariance's weight arguments
    (`leaves`, by argument name): the stacked ones split in halves, as CUEQ_WEIGHTS stacks them."""
    gradients = {}
    for arg, names in CUEQ_WEIGHTS.items():
        grad = leaves[arg].grad
        gradients.update(zip(names, [None] * len(names) if grad is None else grad.chunk(len(names))))
    return gradients


def trainable_cueq(ref, dtype):
    """cuEquivariance's update with the reference's weights in `dtype` as leaves requiring grad."""
    cuet = cuequivariance()
    leaves = {arg: w.requires_grad_(True) for arg, w in cueq_weights(ref, dtype).items()}
    return Trainable(lambda x, m: cuet.triangle_multiplicative_update(x, direction=ref.direction, mask=m,
                                                                     eps=1e-5, **leaves),
                     list(leaves.values()), lambda: cueq_gradients(leaves))


BACKWARD_CONTENDERS = "ref-eager,ref-compile,ref-autocast,cueq-bf16,cueq-fp32,new,new-bf16,new-autocast"
# (named only: a compile per shape and precision; use cases' rows)
BACKWARD_OPTIONAL = "new-compile,new-frozen,new-bf16-checkpoint"


def backward_contenders(args):
    """The --backward contenders that --contenders names (`new`: one row per --precision)."""
    bf16 = torch.bfloat16
    found = []
    if "ref-eager" in args.contenders:
        found.append(TrainingContender("ref-eager", trainable_module, "highest"))
    if "ref-compile" in args.contenders:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        found.append(TrainingContender("ref-compile", compiled_trainable, "highest"))
    if "ref-autocast" in args.contenders:
        found.append(TrainingContender("ref-autocast", lambda ref: trainable_module(ref, autocast=True),
                                       "bfloat16", informational=True))
    if "cueq-bf16" in args.contenders and cuequivariance() is not None:
        found.append(TrainingContender("cueq-bf16", lambda ref: trainable_cueq(ref, bf16), "bfloat16",
                                       dtype=bf16, mask_dtype=bf16, informational=True))
    if "cueq-fp32" in args.contenders and cuequivariance() is not None:
        found.append(TrainingContender("cueq-fp32", lambda ref: trainable_cueq(ref, torch.float32), "high",
                                       mask_dtype=torch.float32, informational=True))
    for choice in args.kernels or [ti.Kernels()]:
        found += new_training_contenders(args, choice)
    return found


def new_training_contenders(args, kernels):
    """The ModelNew rows of --backward for one --kernels choice (its name in the label unless auto)."""
    bf16 = torch.bfloat16
    tag = "" if kernels == ti.Kernels() else f"[{kernels}]"
    found = []
    if "new" in args.contenders:
        for precision in args.precision:
            found.append(TrainingContender(f"new-{precision}{tag}", lambda ref, p=precision: trainable_module(
                make_model_new(ref, kernels, precision=p)), precision))
    if "new-bf16" in args.contenders:
        found.append(TrainingContender(f"new-bf16{tag}", lambda ref: trainable_module(
            make_model_new(ref, kernels).to(bf16)), "bfloat16", dtype=bf16))
    if "new-autocast" in args.contenders:
        found.append(TrainingContender(f"new-autocast{tag}", lambda ref: trainable_module(
            make_model_new(ref, kernels), autocast=True), "bfloat16"))
    if "new-bf16-checkpoint" in args.contenders:  # (as models train long crops: a layer per checkpoint)
        found.append(TrainingContender(f"new-bf16-checkpoint{tag}", lambda ref: checkpointed_trainable(
            make_model_new(ref, kernels).to(bf16)), "bfloat16", dtype=bf16))
    if "new-frozen" in args.contenders:
        for precision in args.precision:
            found.append(TrainingContender(f"new-frozen-{precision}{tag}", lambda ref, p=precision: frozen_trainable(
                make_model_new(ref, kernels, precision=p)), precision))
    if "new-compile" in args.contenders:  # (a model that torch.compile wraps whole: the op traced, not eager)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for precision in args.precision:
            found.append(TrainingContender(f"new-compile-{precision}{tag}", lambda ref, p=precision:
                                           compiled_trainable(make_model_new(ref, kernels, precision=p)), precision))
    return found


def checkpointed_trainable(module):
    """trainable_module of module under torch.utils.checkpoint (non-reentrant): the forward again in the
    backward."""
    return trainable_module(module, lambda pair, mask: torch.utils.checkpoint.checkpoint(module, pair, mask,
                                                                                         use_reentrant=False))


def compiled_trainable(module):
    """trainable_module of torch.compile(module), training module's own parameters."""
    return trainable_module(module, torch.compile(module))


def clear_gradients(trainable, pair):
    """Sets the gradients of pair_repr and of the trained tensors to None (their memory released) and marks the
    trained tensors changed, as an optimizer's in-place step would (their version counters, no kernel): a
    contender that caches work derived from its parameters (ModelNew's kernel-layout weights) redoes it every
    step, as in training."""
    pair.grad = None
    for tensor in trainable.leaves:
        tensor.grad = None
        torch.autograd.graph.increment_version(tensor)


def training_step(trainable, pair, mask):
    """One training step as --backward times it: the gradients set to None and the parameters marked updated
    (inside the step: host work, clear_gradients), forward, loss = mean of out² in fp32, backward.
    `pair`: a leaf requiring grad."""
    def step():
        clear_gradients(trainable, pair)
        trainable.forward(pair, mask).float().square().mean().backward()
    return step


def warm_up_beside(fn, calls=3):
    """fn() `calls` times on a side stream, the current stream waiting for them: PyTorch's warm-up before a CUDA
    graph capture (lazy set-up, cuBLAS workspaces and autotuning happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def graphed_training_step(trainable, pair, mask):
    """training_step captured whole in one CUDA graph (forward, loss, backward; the parameters marked updated
    before the capture, so work derived from them is captured and redone on every replay), as a caller who
    captures its step runs it: the step's host work gone, its GPU work left. Warmed up eagerly on a side stream
    first (lazy set-up, autotuning). The gradients are the capture's tensors, rewritten by every replay; the
    returned replay must run before they hold anything. Also returns the MiB the capture's private memory pool
    took (the step's intermediates and gradients: a graphed step's memory). A contender that cannot be captured
    raises RuntimeError naming the failure."""
    warm_up_beside(training_step(trainable, pair, mask))
    drop_trimul_graphs()  # (the eager warm-up's, which the captured step does not use: held counts the capture's)
    clear_gradients(trainable, pair)
    reserved = settled_reserved_bytes()  # (torch.cuda.graph empties the cache as it starts: settle it first)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            trainable.forward(pair, mask).float().square().mean().backward()
    except Exception as error:
        raise RuntimeError(f"the training step could not be captured in a CUDA graph: "
                           f"{type(error).__name__}: {error}") from error
    torch.cuda.synchronize()
    pool_mib = (torch.cuda.memory_reserved() - reserved) / 2**20
    return graph.replay, pool_mib


def poison_gradients(trainable, pair):
    """Fills every gradient tensor the step keeps with NaN (a replay that fails to rewrite one shows)."""
    for grad in [pair.grad] + [t.grad for t in trainable.leaves]:
        if grad is not None:
            grad.fill_(float("nan"))


def step_gradients(trainable, pair):
    """{"pair_repr": d pair_repr, Model's parameter name: gradient} after a step."""
    return {"pair_repr": pair.grad, **trainable.gradients()}


# Shapes whose whole float64 gradients would not fit are checked by direction instead (DirectionalReference):
# the directional derivatives must agree within this along the gradient itself (a correct gradient's
# disagreement is second order in its error; a wrong or scaled one's is O(its share)) and within
# RANDOM_DIRECTION_TOLERANCE along a random direction (scaled by |g| |v| / sqrt(numel): a gradient with a part
# missing (zeroed rows: orthogonal to its own direction) shows there as ~|N(0, 1)| x the missing part's share,
# over the tolerance with probability ~0.75 per tensor at a half; a correct one's as its relative error).
DIRECTIONAL_TOLERANCE = 1e-2
RANDOM_DIRECTION_TOLERANCE = 0.3


def dot64(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 24) -> float:
    """<a, b> accumulated in float64, `chunk` elements at a time (no float64 copy of a pair-sized tensor)."""
    a, b = a.reshape(-1), b.reshape(-1)
    return sum(torch.dot(a[i:i + chunk].double(), b[i:i + chunk].double()).item() for i in range(0, a.numel(), chunk))


def norm64(t: torch.Tensor) -> float:
    """||t|| accumulated in float64 (dot64)."""
    return math.sqrt(dot64(t, t))


class DirectionalReference:
    """For shapes over SAMPLED_ABOVE positions, where whole float64 gradients would not fit: for pair_repr and for
    each parameter, the float64 loss (mean of out^2, out from ModelNew's chunked forward in float64)
    differentiated by central differences along the contender's own gradient g of that tensor and along a random
    direction v (steps of `step` times the tensor's norm), against what g says those derivatives are (|g|^2 and
    <g, v>). Precision itself is what the whole-tensor checks at the smaller shapes measure. Four chunked float64
    forwards per tensor. Memory: one float64 pair at a time, the update written over it (forward_chunked's
    out=pair); g and v stay in g's dtype, their sums accumulated in float64 (so N = 4096 is checked on an 80 GB
    card beside the contender's step)."""

    def __init__(self, ref, pair, mask, gate_input=None, step=1e-4, chunk_size=None, seed=0):
        self.model = make_model_new(ref, precision="highest", gate_input=gate_input).to(pair.device, torch.float64)
        self.stepped = copy.deepcopy(self.model)  # (the parameters moved along a gradient, loss(params=...))
        self.pair, self.mask, self.step, self.chunk_size = pair.detach(), mask, step, chunk_size
        self.pair_norm = norm64(self.pair)  # (each pair_repr slope's step scale: one pass over the pair)
        self.generator = torch.Generator(pair.device).manual_seed(seed)

    def loss(self, shift=None, params=None):
        """mean(out^2) in float64 at pair_repr + shift (shift: (scale, tensor)) and, where given, the parameters
        {name: value}; one float64 copy of the pair at a time."""
        model = self.model
        if params is not None:
            model = self.stepped
            model.load_state_dict(params)
        with torch.no_grad():
            pair = self.pair.double()
            if shift is not None:
                pair.add_(shift[1].to(pair.device), alpha=shift[0])
            out = model.forward_chunked(pair, self.mask, self.chunk_size, out=pair)  # (the update, over pair)
            return dot64(out, out) / max(out.numel(), 1)

    def slope(self, name, base, direction):
        """The float64 loss's derivative along `direction` (a tensor shaped as `name`), by central differences."""
        value_norm = self.pair_norm if name == "pair_repr" else norm64(base[name])
        h = self.step * max(value_norm, 1.0) / max(norm64(direction), 1e-300)
        if name == "pair_repr":
            return (self.loss((h, direction)) - self.loss((-h, direction))) / (2 * h)
        direction = direction.to(device=base[name].device, dtype=torch.float64)
        step = lambda sign: {**base, name: base[name] + sign * h * direction}  # noqa: E731
        return (self.loss(params=step(1)) - self.loss(params=step(-1))) / (2 * h)

    def errors(self, gradients, names=None):
        """{tensor name + " (direction)": | |g|^2 - slope along g | / |g|^2, and + " (random direction)":
        | <g, v> - slope along v | / (|g| |v| / sqrt(numel))} for pair_repr and each parameter (those in `names`
        where given; inf where a gradient is missing)."""
        errors = {}
        base = self.model.state_dict()
        for name in ["pair_repr"] + list(base):
            if names is not None and name not in names:
                continue
            g = gradients.get(name)
            if g is None:
                errors[f"{name} (direction)"] = errors[f"{name} (random direction)"] = math.inf
                continue
            g_norm = norm64(g)
            errors[f"{name} (direction)"] = abs(g_norm * g_norm - self.slope(name, base, g)) / max(g_norm ** 2,
                                                                                                  1e-300)
            v = torch.randn(g.shape, generator=self.generator, device=g.device, dtype=g.dtype)  # (any direction)
            scale = g_norm * norm64(v) / math.sqrt(max(g.numel(), 1))
            errors[f"{name} (random direction)"] = abs(dot64(g, v) - self.slope(name, base, v)) / max(scale, 1e-300)
        return errors


def gradient_check(gradients, expected, tolerance_key, names=None):
    """(errors, passed): the relative error ||g - g_ref|| / ||g_ref|| of each gradient in `gradients`
    against `expected` (fp64, same names; those in `names` where given; a missing gradient: inf), and whether
    pair_repr's and each parameter's are within GRAD_TOLERANCE[tolerance_key] (NaN is not)."""
    if isinstance(expected, DirectionalReference):
        errors = expected.errors(gradients, names)
        return errors, all(error <= (RANDOM_DIRECTION_TOLERANCE if name.endswith("(random direction)")
                                     else DIRECTIONAL_TOLERANCE) for name, error in errors.items())
    pair_tolerance, parameter_tolerance = GRAD_TOLERANCE[tolerance_key]
    errors = {name: math.inf if gradients.get(name) is None else relative_error(gradients[name], reference)
              for name, reference in expected.items() if names is None or name in names}
    passed = all(error <= (pair_tolerance if name == "pair_repr" else parameter_tolerance)
                 for name, error in errors.items())
    return errors, passed


def worst_gradient(errors):
    """(name, error) of the largest of gradient_check's errors, NaN counting as the largest."""
    name = max(errors, key=lambda n: math.inf if math.isnan(errors[n]) else errors[n])
    return name, errors[name]


def bench_backward_contender(contender, ref, pair, mask, expected, shape, label, budget, cuda_graph=False):
    """One --backward row: a training step's gradients checked against `expected` (fp64), then, within
    tolerance (or informational), the step timed and its peak memory above the inputs and parameters
    (the previous step's gradients released first). cuda_graph: the step captured whole in a CUDA graph
    (graphed_training_step), its gradients checked after a replay over poisoned ones, each timed call a replay,
    and the peak the capture's memory pool."""
    row = {"shape": list(shape), "contender": contender.name, "status": "ok"}
    reserved = held_memory_start()
    try:
        trainable = contender.make(ref)
        pair_in = pair.detach().to(contender.dtype).requires_grad_(True)
        if cuda_graph:
            step, pool_mib = graphed_training_step(trainable, pair_in, mask.to(contender.mask_dtype))
            poison_gradients(trainable, pair_in)
        else:
            step = training_step(trainable, pair_in, mask.to(contender.mask_dtype))
        step()
        errors, passed = gradient_check(step_gradients(trainable, pair_in), expected, contender.tolerance_key,
                                        trainable.checked)
        worst_name, worst_error = worst_gradient(errors)
        row.update(grad_errors=errors, worst_tensor=worst_name, worst_error=worst_error, over_tolerance=not passed)
        tolerance = "d pair_repr {:.0e}, parameters {:.0e}".format(*GRAD_TOLERANCE[contender.tolerance_key])
        if not (passed or contender.informational):
            row["status"] = "FAIL"
            log(f"{label}: FAIL, worst gradient error {worst_error:.2e} ({worst_name}) over tolerance "
                f"({tolerance}); not timed")
            return row
        verdict = "ok" if passed else f"over tolerance ({tolerance}; informational)"
        log(f"{label}: worst gradient error {worst_error:.2e} ({worst_name}) {verdict}; timing")
        median, low, high, reps = time_cuda(step, budget_s=budget)
        if not cuda_graph:  # (a replay writes the capture's gradients: nothing to release, nothing allocated)
            clear_gradients(trainable, pair_in)
        row.update(median_us=median, p10_us=low, p90_us=high, reps=reps,
                   peak_mib=pool_mib if cuda_graph else peak_memory_mib(step))
        clear_gradients(trainable, pair_in)
        del trainable, step, pair_in
        row["held_mib"] = held_memory_mib(reserved)
    except Exception as error:  # one broken contender must not hide the others
        row["status"] = "ERROR"
        row["error"] = f"{type(error).__name__}: {error}"[:300]
        log(f"{label}: ERROR {row['error']}")
    return row


def bench_backward_shape(shape, args, index, total):
    """The --backward rows of one shape (bench_backward_contender), against fp64 gradients of the
    seeded reference."""
    ref, pair, mask = seeded_case(shape, args, args.seed + index)
    chosen = backward_contenders(args)
    # cuEquivariance gates with the normalized input, so it needs that reference too; 16-bit contenders
    # are checked at their rounded inputs and parameters (fp64_gradients).
    def reference_of(contender):
        gate_input = "normalized" if contender.name.startswith("cueq") else args.gate_input
        return gate_input, None if contender.dtype == torch.float32 else contender.dtype
    batch, n = shape[:2]
    if long_shape(batch, n):  # (checks gradients by direction: no precision measured, no rounding needed)
        reference = lambda gate_input, rounded_to: DirectionalReference(ref, pair, mask, gate_input)
    else:
        reference = lambda gate_input, rounded_to: fp64_gradients(ref, pair, mask, gate_input, rounded_to)
    expected_for = {key: reference(*key) for key in {reference_of(contender) for contender in chosen}}
    rows = []
    for contender in chosen:
        label = f"[{index + 1}/{total}] {shape} {contender.name}"
        rows.append(bench_backward_contender(contender, ref, pair, mask, expected_for[reference_of(contender)],
                                             shape, label, args.budget, args.cuda_graph))
        torch.cuda.empty_cache()
    return rows


def print_grid(title, rows, key, cell, footer=None):
    """A table of `rows`: a line per shape, a column per contender, cell(row) where the row has `key`
    (else its status); `footer`: (label, {contender: text}) as the last line."""
    names = list(dict.fromkeys(row["contender"] for row in rows))
    grid = {}
    for row in rows:
        grid.setdefault(",".join(str(s) for s in row["shape"]), {})[row["contender"]] = \
            cell(row) if key in row else row["status"]
    lines = list(grid.items()) + ([footer] if footer else [])
    first = max([len("B,N,C,H")] + [len(label) for label, _ in lines])
    widths = [max([len(name)] + [len(cells.get(name, "-")) for _, cells in lines]) for name in names]
    header = "  ".join([f"{'B,N,C,H':<{first}}"] + [f"{n:>{w}}" for n, w in zip(names, widths)])
    print(f"\n{title}\n{header}\n{'-' * len(header)}")
    for label, cells in lines:
        print("  ".join([f"{label:<{first}}"] + [f"{cells.get(n, '-'):>{w}}" for n, w in zip(names, widths)]))


def print_backward_tables(rows, cuda_graph=False):
    """The --backward tables, a line per shape and a column per contender: median µs per training step
    (p10-p90) with the geomean over GEOMEAN_SHAPES, peak MiB (cuda_graph: the capture's memory pool), and the
    worst gradient error with its tensor ("!": over tolerance). Returns the geomeans."""
    geomean_rows = geomeans(rows)
    step = "training step replayed from one CUDA graph" if cuda_graph else "training step"
    print_grid(f"median us per {step} (p10-p90)", rows, "median_us",
               lambda r: f"{r['median_us']:.0f} ({r['p10_us']:.0f}-{r['p90_us']:.0f})",
               footer=("geomean (7 large)", {name: f"{t:.0f}" for name, t in geomean_rows.items()}))
    print_grid("MiB of the step's CUDA graph pool (its intermediates and gradients)" if cuda_graph else
               "peak MiB per training step, above inputs and parameters", rows, "peak_mib",
               lambda r: f"{r['peak_mib']:.0f}")
    print_grid("held MiB after the steps (CUDA graph pools and buffers; peak + held is a graphed step's memory)",
               rows, "held_mib", lambda r: f"{r['held_mib']:.0f}")
    print_grid("worst gradient error vs fp64, ||g - g_ref|| / ||g_ref||", rows, "worst_error",
               lambda r: f"{r['worst_error']:.1e} {r['worst_tensor']}{' !' if r['over_tolerance'] else ''}")
    return geomean_rows


def cpu_backward_check(args):
    """No GPU: ModelNew's fp32 gradients (its CPU fallback: the reference computation) against fp64 on
    CPU_BACKWARD_SHAPES, every tensor's error printed, through the checks --backward runs on a GPU."""
    print("CUDA is not available: checking ModelNew's fp32 gradients against fp64 on CPU instead (ModelNew "
          "falls back to the reference computation on CPU).")
    failed = False
    for index, shape in enumerate(CPU_BACKWARD_SHAPES):
        ref, pair, mask = seeded_case(shape, args, args.seed + index, device="cpu")
        trainable = trainable_module(make_model_new(ref))
        pair_in = pair.detach().requires_grad_(True)
        training_step(trainable, pair_in, mask)()
        errors, passed = gradient_check(step_gradients(trainable, pair_in), fp64_gradients(ref, pair, mask),
                                        "highest")
        failed |= not passed
        print(f"\n{shape} direction={args.direction} gate_input={args.gate_input}: "
              f"{'ok' if passed else 'FAIL'} (tolerance {GRAD_TOLERANCE['highest'][0]:.0e})")
        for name, error in errors.items():
            print(f"  {name:<24} rel err {error:.1e}")
    return 1 if failed else 0


def command_line(argv):
    """The command as run, for the header, quoted as a shell would need it (--shapes' ';')."""
    return "python " + shlex.join([sys.argv[0]] + (sys.argv[1:] if argv is None else list(argv)))


def utc_stamp():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_commit():
    """This checkout's commit ("-dirty": with uncommitted changes or untracked files outside ignored paths, which
    the build may compile: every file in kernels/ is a kernel), or None outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=here).stdout.strip()
        changes = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True,
                                 cwd=here).stdout.strip()
        return head + ("-dirty" if changes else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def details_line(details) -> str:
    return (f"{details['date']} on {details['gpu']}, torch {details['torch']}, CUDA {details['cuda']}, commit "
            f"{details['commit']}" + (f", TRIMUL_KERNELS={details['trimul_kernels']}" if details["trimul_kernels"]
                                      else "")
            + (f", cuequivariance {details['cuequivariance']}" if details["cuequivariance"] else ""))


def run_details(gpu) -> dict:
    """What a results file records besides its rows: the command, date, GPU, versions, commit and the kernel
    override in force (TRIMUL_KERNELS: it replaces the rows' kernels without changing their names)."""
    cueq = cuequivariance()
    return {"date": utc_stamp(), "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "commit": git_commit(),
            "trimul_kernels": os.environ.get("TRIMUL_KERNELS") or None,
            "cuequivariance": getattr(cueq, "__version__", None) if cueq is not None else None}


def run_backward(args, argv):
    """--backward: each shape's rows (bench_backward_shape), then the tables under the run's header;
    --json rewritten after every shape. Without CUDA: cpu_backward_check."""
    if not torch.cuda.is_available():
        return cpu_backward_check(args)
    gpu = torch.cuda.get_device_name()
    log(f"bench --backward on {gpu}, torch {torch.__version__}; building/loading the extension")
    ti.reload_extension()
    if cuequivariance() is None and args.contenders & {"cueq-bf16", "cueq-fp32"}:
        log("cuequivariance_torch does not import here: no cueq rows")
    command, details = command_line(argv), run_details(gpu)

    def save(rows, geomean_rows=None):
        if args.json:  # after every shape, so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"mode": "backward", "command": command, **details, "precision": args.precision,
                           "direction": args.direction, "gate_input": args.gate_input,
                           "cuda_graph": args.cuda_graph, "rows": rows, "geomean_us": geomean_rows or {}}, f,
                          indent=1)

    rows = []
    for index, shape in enumerate(args.shapes):
        rows += bench_backward_shape(shape, args, index, len(args.shapes))
        save(rows)
    print(f"\n{command}\n{details_line(details)}\n"
          f"training step: out = fn(pair, mask); out.float().square().mean().backward(); "
          f"direction={args.direction}, gate_input={args.gate_input}"
          + ("; each step one replay of its CUDA graph (--cuda-graph)" if args.cuda_graph else ""))
    save(rows, print_backward_tables(rows, args.cuda_graph))
    return 1 if any(r["status"] != "ok" and r["contender"].startswith("new") for r in rows) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES,
                        help="B,N,C,H;B,N,C,H;... (default: the nine standard shapes)")
    parser.add_argument("--kernels", type=parse_kernel_choices,
                        help="ModelNew kernel choices to time, comma-separated: auto, a contraction kernel, or "
                             "role=name[+role=name...] (`python trimul_inline.py kernels` lists them; default: auto "
                             "and every contraction kernel); a named choice at the first --precision whose call "
                             "it takes, and (named here) a new-bf16 row of its own; with --profile or --repeat-only the choices to profile (default auto), "
                             "several: an A/B in one process; with --backward the choices whose training step the new* rows time "
                             "(default auto)")
    parser.add_argument("--contenders",
                        help="which of ref-eager, ref-compile, ref-autocast, cueq (when "
                             "cuequivariance_torch imports), new-bf16 (ModelNew with bf16 in/out, as cueq "
                             "bf16 runs), new to run (default: all); with --backward which of "
                             f"{BACKWARD_CONTENDERS},{BACKWARD_OPTIONAL} (cueq-*: when cuequivariance_torch "
                             "imports; new: one row per --precision; new-bf16: bf16 parameters and inputs; "
                             "new-autocast: under bf16 autocast; new-compile: torch.compile(ModelNew), one row per "
                             "--precision; new-frozen: ModelNew with frozen parameters (d pair_repr only), one row "
                             "per --precision; new-bf16-checkpoint: new-bf16 under torch.utils.checkpoint; default: "
                             "all but new-compile, new-frozen and new-bf16-checkpoint)")
    parser.add_argument("--precision", default="highest",
                        help="ModelNew's fp32 precisions, comma-separated (PyTorch's matmul-precision "
                             "names: highest, high, medium)")
    parser.add_argument("--direction", choices=ti.DIRECTIONS, default="outgoing")
    parser.add_argument("--gate-input", choices=ti.GATE_INPUTS,
                        help="what the output gate reads (default: raw; with --backward normalized, "
                             "cuEquivariance's and the issue's tables')")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every row and the run's details here")
    parser.add_argument("--repeat-only", type=int, default=0, metavar="CALLS",
                        help="just run ModelNew[--kernels, default auto] CALLS times per shape/precision (a target for ncu)")
    parser.add_argument("--profile", action="store_true",
                        help="print ModelNew's per-kernel CUDA time per shape instead of the table, then its forward "
                             "timed as the table times it and the kernels' sum right after (a hot GPU)")
    parser.add_argument("--bf16-inputs", action="store_true",
                        help="keep only a bf16 copy of the inputs once the reference is computed (long shapes, where "
                             "the fp32 copy would not fit beside the contenders); bf16 contenders only")
    parser.add_argument("--float-mask", action="store_true",
                        help="pass the mask as float32 0/1 (as Boltz and OpenFold do) instead of bool (forward)")
    parser.add_argument("--backward", action="store_true",
                        help="time a training step per call (forward, loss = mean of out² in fp32, backward) "
                             "after checking every gradient against fp64")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="with --backward: capture each contender's whole training step in one CUDA graph "
                             "and time its replays (the step's GPU work without its host work, as a caller who "
                             "captures its step runs it; a contender that cannot be captured gets an ERROR row)")
    args = parser.parse_args(argv)
    args.precision = [p for p in args.precision.split(",") if p]
    for precision in args.precision:
        if precision not in ti.PRECISIONS:
            parser.error(f"unknown precision {precision!r}; known: {ti.PRECISIONS}")
    args.gate_input = args.gate_input or ("normalized" if args.backward else "raw")
    if args.contenders is None:
        args.contenders = BACKWARD_CONTENDERS if args.backward else DEFAULT_CONTENDERS
    args.contenders = set(args.contenders.split(","))
    if args.backward:
        if args.profile or args.repeat_only or args.float_mask:
            parser.error("--profile, --repeat-only and --float-mask apply to the forward mode, not --backward")
        known = f"{BACKWARD_CONTENDERS},{BACKWARD_OPTIONAL}"
        unknown = args.contenders - set(known.split(","))
        if unknown:
            parser.error(f"--backward: unknown contenders {sorted(unknown)}; known: {known}")
        return run_backward(args, argv)
    if args.cuda_graph:
        parser.error("--cuda-graph applies to --backward (the training step)")
    unknown = args.contenders - set(FORWARD_CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; known: {','.join(FORWARD_CONTENDERS)}")
    long_shapes = any(long_shape(b, n) for b, n, _, _ in args.shapes)
    args.bf16_kernels = args.kernels  # (the new-bf16 rows: the choices named, else auto alone)
    if args.kernels is None:  # (every named contraction too, but not at long shapes: naive alone takes minutes)
        contractions = [e.name for e in ti.kernel_registry() if e.role == "contract"]
        args.kernels = [ti.Kernels()] + ([] if args.profile or args.repeat_only or long_shapes else
                                        [ti.Kernels(contract=name) for name in contractions])
    if args.bf16_inputs and not args.contenders <= {"cueq", "new-bf16"}:
        parser.error("--bf16-inputs: only the bf16 contenders (cueq's bf16 row, new-bf16) read bf16 inputs")

    if not torch.cuda.is_available():
        return cpu_comparison()

    gpu = torch.cuda.get_device_name()
    log(f"bench on {gpu}, torch {torch.__version__}; building/loading the extension")
    ti.reload_extension()
    if "cueq" in args.contenders and cuequivariance() is None:
        log("cuequivariance_torch does not import here: no cueq rows")
    if args.profile or args.repeat_only:
        return 1 if profile_kernels(args.shapes, args, args.repeat_only) else 0
    command, details = command_line(argv), run_details(gpu)

    def save(rows, geomean_rows=None):
        if args.json:  # after every shape, so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"command": command, **details, "precision": args.precision, "direction": args.direction,
                           "gate_input": args.gate_input, "rows": rows, "geomean_us": geomean_rows or {}}, f,
                          indent=1)

    rows = []
    for index, shape in enumerate(args.shapes):
        rows += bench_shape(shape, args, index, len(args.shapes))
        save(rows)
    print(f"\n{command}\n{details_line(details)}")
    save(rows, print_table(rows, ",".join(args.precision)))
    # (a wrong result anywhere fails the run; an error (cuEquivariance out of memory at long N) fails ours only)
    return 1 if any(r["status"] == "FAIL" or (r["status"] != "ok" and r["contender"].startswith("new["))
                    for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

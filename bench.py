"""bench.py — check every contender against an fp64 reference, then time it.

    python bench.py                                   # default shapes, every contender
    python bench.py --shapes 1,256,128,128 --kernels tiled --precision high --json out.json
    python bench.py --profile --kernels input=wgmma_rs,input=wgmma_ws   # A/B two kernels in one process

For each shape (B, N, C, H) each contender is first checked against the reference model run in
float64 (relative error ||out - ref|| / ||ref||); a contender over its tolerance prints FAIL and is
not timed. Timing: CUDA events around each forward call, after warm-up, median of many calls with
the 10th-90th percentile spread, and the peak memory the call allocated beyond what was already
allocated. Without CUDA it says so and runs a small CPU comparison.
"""
import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time

import torch

import trimul_inline as ti

DEFAULT_SHAPES = [(1, 32, 64, 32), (16, 32, 64, 32), (2, 256, 128, 128), (1, 512, 128, 128),
                  (1, 768, 128, 128), (1, 1024, 128, 128), (2, 256, 384, 128), (1, 768, 384, 128),
                  (1, 1024, 384, 128)]
# The geomean row covers the seven shapes large enough not to be launch-bound (issue 3's table).
GEOMEAN_SHAPES = DEFAULT_SHAPES[2:]
TOLERANCE = {"highest": 1e-5, "high": 2e-3, "medium": 1e-2, "bfloat16": 2e-2}


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


def make_cueq(ref, dtype):
    """cuEquivariance's fused triangle update on the reference's weights. It gates the output with
    the normalized input (AlphaFold2's convention), so it is checked against gate_input='normalized'.
    Inputs are cast to `dtype` once, outside the timed call."""
    cuet = cuequivariance()
    cat = lambda first, second: torch.cat([first, second], dim=0)
    weights = dict(
        norm_in_weight=ref.layer_norm_in.weight, norm_in_bias=ref.layer_norm_in.bias,
        p_in_weight=cat(ref.proj_a.weight, ref.proj_b.weight), p_in_bias=cat(ref.proj_a.bias, ref.proj_b.bias),
        g_in_weight=cat(ref.gate_a.weight, ref.gate_b.weight), g_in_bias=cat(ref.gate_a.bias, ref.gate_b.bias),
        norm_out_weight=ref.layer_norm_out.weight, norm_out_bias=ref.layer_norm_out.bias,
        p_out_weight=ref.out_proj.weight, p_out_bias=ref.out_proj.bias,
        g_out_weight=ref.out_gate.weight, g_out_bias=ref.out_gate.bias)
    weights = {k: v.detach().to(dtype).contiguous() for k, v in weights.items()}
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
            converted[key] = (pair.to(pair_dtype), mask.to(mask_dtype))
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


def make_new_bf16_io(ref):
    """ModelNew[auto] in bf16, given bf16 inputs (cast once, outside the timed calls) and writing bf16:
    the like-for-like row against cuEquivariance bf16, which reads and writes bf16 too (the "medium"
    rows read and write fp32: twice the bytes)."""
    new = make_model_new(ref).to(torch.bfloat16)
    return cast_once(new, torch.bfloat16, torch.bool)


def make_model_new(ref, kernels=None, precision=None):
    """ModelNew with the reference's weights, on the reference's device."""
    new = ti.ModelNew(ref.pair_dim, ref.hidden_dim, ref.direction, ref.gate_input, kernels=kernels,
                      precision=precision)
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
        found.append(Contender("cueq fp32", lambda ref: make_cueq(ref, torch.float32), "high"))
        found.append(Contender("cueq bf16", lambda ref: make_cueq(ref, torch.bfloat16), "bfloat16"))
    if "new-bf16" in args.contenders:
        found.append(Contender("new[auto] bf16 in/out", make_new_bf16_io, "bfloat16"))
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
    quantile = lambda q: times[min(len(times) - 1, int(q * len(times)))]
    return statistics.median(times), quantile(0.1), quantile(0.9), reps


def peak_memory_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def fp64_output(ref, pair, mask, gate_input=None):
    """The reference's output in float64 (its weights; another gate input where given), on ref's device."""
    ref64 = ti.Model(ref.pair_dim, ref.hidden_dim, ref.direction, gate_input or ref.gate_input)
    ref64 = ref64.to(ref.proj_a.weight.device).double()
    ref64.load_state_dict(ref.state_dict())
    with torch.inference_mode():
        return ref64(pair.double(), mask)


def relative_error(out, expected):
    """||out - expected|| / ||expected|| in float64."""
    return ((out.double() - expected).norm() / expected.norm()).item()


def bench_shape(shape, args, index, total):
    ref, pair, mask = seeded_case(shape, args, args.seed + index)
    # cuEquivariance gates with the normalized input, so it needs that reference too.
    gate_inputs = {args.gate_input} | ({"normalized"} if "cueq" in args.contenders else set())
    expected_for = {gate_input: fp64_output(ref, pair, mask, gate_input) for gate_input in gate_inputs}
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
                out = call()
                torch.cuda.synchronize()
                expected = expected_for["normalized" if contender.name.startswith("cueq")
                                        else args.gate_input]
                err = relative_error(out, expected)
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
        if tuple(row["shape"]) in wanted and "median_us" in row:
            by_contender.setdefault(row["contender"], []).append(row["median_us"])
    return {name: math.exp(sum(math.log(t) for t in times) / len(times))
            for name, times in by_contender.items() if len(times) == len(wanted)}


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
    for shape in shapes:
        ref, pair, mask = seeded_case(shape, args, args.seed)
        expected = fp64_output(ref, pair, mask) if len(args.kernels) > 1 and not repeat_only else None
        for precision in args.precision:
            models = {str(choice): make_model_new(ref, choice, precision) for choice in args.kernels}
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
                            errors[name] = relative_error(out, expected)
                        del out
                    if not repeat_only:
                        measured[name].append(kernel_times(new, pair, mask))
                        forwards[name].append(forward_against_kernels(new, pair, mask, args.budget))
            if repeat_only:
                continue
            print(f"\n{shape} {precision}: CUDA time per forward by kernel (TFLOP/s and GB/s from kernel_work's"
                  f" useful FLOPs and fewest bytes)")
            for name in models:
                error = f"rel error vs fp64 {errors[name]:.1e}; " if name in errors else ""
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES,
                        help="B,N,C,H;B,N,C,H;... (default: the nine standard shapes)")
    parser.add_argument("--kernels", type=parse_kernel_choices,
                        help="ModelNew kernel choices to time, comma-separated: auto, a contraction kernel, or "
                             "role=name[+role=name...] (`python trimul_inline.py kernels` lists them; default: auto "
                             "and every contraction kernel); a named choice at the first --precision whose call "
                             "it takes; with --profile or --repeat-only the choices to profile (default auto), "
                             "several: an A/B in one process")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                        help="which of ref-eager, ref-compile, ref-autocast, cueq (when "
                             "cuequivariance_torch imports), new-bf16 (ModelNew with bf16 in/out, as cueq "
                             "bf16 runs), new to run")
    parser.add_argument("--precision", default="highest",
                        help="ModelNew's fp32 precisions, comma-separated (PyTorch's matmul-precision "
                             "names: highest, high, medium)")
    parser.add_argument("--direction", choices=ti.DIRECTIONS, default="outgoing")
    parser.add_argument("--gate-input", choices=ti.GATE_INPUTS, default="raw")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every row and the run's details here")
    parser.add_argument("--repeat-only", type=int, default=0, metavar="CALLS",
                        help="just run ModelNew[--kernels, default auto] CALLS times per shape/precision (a target for ncu)")
    parser.add_argument("--profile", action="store_true",
                        help="print ModelNew's per-kernel CUDA time per shape instead of the table, then its forward "
                             "timed as the table times it and the kernels' sum right after (a hot GPU)")
    args = parser.parse_args(argv)
    if args.kernels is None:
        contractions = [e.name for e in ti.kernel_registry() if e.role == "contract"]
        args.kernels = [ti.Kernels()] + ([] if args.profile or args.repeat_only else
                                        [ti.Kernels(contract=name) for name in contractions])
    args.contenders = set(args.contenders.split(","))
    args.precision = [p for p in args.precision.split(",") if p]
    for precision in args.precision:
        if precision not in ti.PRECISIONS:
            parser.error(f"unknown precision {precision!r}; known: {ti.PRECISIONS}")

    if not torch.cuda.is_available():
        return cpu_comparison()

    gpu = torch.cuda.get_device_name()
    log(f"bench on {gpu}, torch {torch.__version__}; building/loading the extension")
    ti.reload_extension()
    if args.profile or args.repeat_only:
        profile_kernels(args.shapes, args, args.repeat_only)
        return 0
    command = "python " + " ".join([sys.argv[0]] + (sys.argv[1:] if argv is None else list(argv)))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def save(rows, geomean_rows=None):
        if args.json:  # after every shape, so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"command": command, "date": stamp, "gpu": gpu, "torch": torch.__version__,
                           "cuda": torch.version.cuda, "python": platform.python_version(),
                           "precision": args.precision, "direction": args.direction,
                           "gate_input": args.gate_input, "rows": rows,
                           "geomean_us": geomean_rows or {}}, f, indent=1)

    rows = []
    for index, shape in enumerate(args.shapes):
        rows += bench_shape(shape, args, index, len(args.shapes))
        save(rows)
    print(f"\n{command}\n{stamp} on {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    save(rows, print_table(rows, ",".join(args.precision)))
    failed = [r for r in rows if r["status"] != "ok"]
    return 1 if any(r["contender"].startswith("new[") for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Random configurations of the CPU-run paths against the float64 reference, for a time budget: the chunked forward
and the in-place update (random _InPlacePlan sizes, chunk sizes, lean or not), and the training op's backward in
both forms (the op and the eager Function: trimul_backward's PyTorch passes). Prints each failing configuration.

    python dev/fuzz_cpu_paths.py [--what inplace|backward] [--seconds 150] [--seed 0]
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import test_trimul as t  # noqa: E402
import trimul_inline as ti  # noqa: E402


def inplace_case(rng, g):
    """One random chunked / in-place configuration: the largest error of update_, forward_chunked(out=pair) and
    forward(chunk_size=...) against pair + the update, the update."""
    n, b, c, h = rng.randint(1, 14), rng.randint(1, 3), rng.choice([4, 6, 10, 16]), rng.choice([2, 5, 8, 16])
    direction, gate = rng.choice(ti.DIRECTIONS), rng.choice(ti.GATE_INPUTS)
    model, reference = t._float64_models(c, h, direction, gate, g, bias=rng.random() < 0.7)
    pair, mask = t.random_inputs(b, n, c, g, mask_dtype=rng.choice([torch.bool, torch.float64]))
    plan = ti._InPlacePlan(rng.randint(1, n + 1), rng.randint(0, n), rng.randint(1, n + 2), rng.randint(1, n + 2),
                           rng.randint(1, 3 * n * n + 5), rng.randint(1, n + 2))
    chunk, lean = rng.choice([None, 1, 2, 3, n, n + 5]), rng.choice([None, True, False])
    made = ti._in_place_plan
    if rng.random() < 0.7:
        ti._in_place_plan = lambda *args: plan
    try:
        with torch.no_grad():
            expected = reference(pair, mask)
            residual = pair.clone()
            model.update_(residual, mask, chunk_size=chunk, lean=lean)
            overwritten = pair.clone()
            model.forward_chunked(overwritten, mask, chunk, out=overwritten, lean=lean)
            chunked = model(pair, mask, chunk_size=chunk or 1)
    finally:
        ti._in_place_plan = made
    label = (b, n, c, h, direction, gate, chunk, lean, plan)
    return max(t.rel_error(residual, pair + expected), t.rel_error(overwritten, expected),
               t.rel_error(chunked, expected)), 1e-10, label


def backward_case(rng, g):
    """One random training-op configuration: the largest gradient error of the op and the eager Function against
    fp64 autograd of the reference (H = 2: LayerNorm_out over two values cancels, so 1e-6)."""
    n, b, c, h = rng.randint(1, 12), rng.randint(1, 3), rng.choice([3, 4, 8, 12]), rng.choice([2, 5, 16])
    direction, gate = rng.choice(ti.DIRECTIONS), rng.choice(ti.GATE_INPUTS)
    model = t.random_layers(ti.Model(c, h, direction, gate, bias=rng.random() < 0.6).double(), g)
    pair, mask = t.random_inputs(b, n, c, g, mask_dtype=rng.choice([torch.bool, torch.float64]))
    if mask.is_floating_point():
        mask = mask * torch.rand(mask.shape, generator=g, dtype=mask.dtype)
    grad_out = torch.randn(pair.shape, generator=g, dtype=torch.float64)
    _, expected = t._gradients(model, pair, mask, grad_out)
    params = ti._with_zero_biases(ti._param_list(model))
    options = ("auto", "highest", direction == "incoming", gate == "normalized", 1e-5, 1e-5)
    forms = (lambda p, m: ti.trimul(p, m, params, [], *options)[0],
             lambda p, m: ti._TrimulFunction.apply(p, m, [], *options, False, False, *params))
    worst = 0.0
    for form in forms:
        _, got = t._gradients(form, pair, mask, grad_out, params=dict(model.named_parameters()))
        worst = max([worst] + [t._grad_error(got[name], grad) for name, grad in expected.items()])
    return worst, 1e-8 if h > 2 else 1e-6, (b, n, c, h, direction, gate, mask.dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--what", choices=("inplace", "backward"), default="inplace")
    parser.add_argument("--seconds", type=float, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, case = random.Random(args.seed), inplace_case if args.what == "inplace" else backward_case
    start, cases, failures = time.time(), 0, 0
    while time.time() - start < args.seconds:
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        try:
            error, bound, label = case(rng, g)
            if error > bound:
                failures += 1
                print(f"FAIL {label}: {error:.2e} > {bound:.0e}", flush=True)
        except Exception as problem:  # (reported: a fuzzer's finding, not fatal)
            failures += 1
            print(f"EXC {type(problem).__name__}: {str(problem)[:300]}", flush=True)
        cases += 1
    print(f"{args.what}: {cases} cases, {failures} failures")


if __name__ == "__main__":
    main()

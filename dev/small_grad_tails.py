"""The tail of ModelNew's gradient error against PyTorch's own reduced-precision reference (test_trimul's
_check_training, repeated over seeds): for each draw the worst ratio err / PyTorch's err over the tensors past
GRAD_TOLERANCE, then the distribution, and each tensor's median ratio. Sizes the `reach` bound of _check_training
(NOTES, training). --seeds replays given seeds exactly as _check_training draws them (a failure's seed).

    python dev/small_grad_tails.py [--draws 200] [--shapes 0,1,2] [--precision medium] [--dtype bf16]
        [--gate-input normalized] [--seeds 2046225854,...]
"""
import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")
import test_trimul as tt  # noqa: E402
import trimul_inline as ti  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def draw(seed, shape, direction, gate_input, dtype, precision):
    """{tensor: (err, PyTorch's err, tolerance)} for one draw, as _check_training makes it from `seed`."""
    found = tt._training_errors(precision, direction, gate_input, *shape, dtype=dtype, seed=seed)[0]
    return {name: (err, floor, tolerance) for name, (err, floor, tolerance, _) in found.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--shapes", default="0,1,2", help="indices into test_trimul.TRAINING_SHAPES")
    parser.add_argument("--precision", default="medium", choices=("high", "medium"))  # (highest has no floor)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--gate-input", default="normalized", choices=ti.GATE_INPUTS)
    parser.add_argument("--directions", default=",".join(ti.DIRECTIONS))
    parser.add_argument("--seeds", help="comma-separated seeds to replay instead of --draws")
    parser.add_argument("--tf32-small", action="store_true",
                        help="keep the TF32 backward of small 16-bit calls (off by default: the bf16 path measured)")
    args = parser.parse_args()
    if not args.tf32_small:
        ti.TF32_BACKWARD_POSITIONS = 0
    dtype = DTYPES[args.dtype]
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [1000 + i for i in range(args.draws)]
    for shape in (tt.TRAINING_SHAPES[int(i)] for i in args.shapes.split(",")):
        for direction in args.directions.split(","):
            worst, per_tensor = [], {}
            for seed in seeds:
                found = draw(seed, shape, direction, args.gate_input, dtype, args.precision)
                past = [(err / floor, name) for name, (err, floor, tol) in found.items() if err > tol]
                worst.append((max(past) if past else (0.0, None)) + (seed,))
                for name, (err, floor, _) in found.items():
                    per_tensor.setdefault(name, []).append(err / floor if floor > 0 else float("inf"))
                if args.seeds:
                    print(f"seed {seed}: " + ", ".join(f"{n} {e:.2e}/{f:.2e}" for n, (e, f, _) in found.items()))
            worst.sort(reverse=True)
            values = [w for w, _, _ in worst]
            medians = sorted(((statistics.median(v), n) for n, v in per_tensor.items()), reverse=True)
            print(f"{shape} {direction} {args.precision} {args.dtype} {args.gate_input}: worst ratios past the "
                  f"tolerance {[(round(r, 2), nm, s) for r, nm, s in worst[:5]]}; >1.5x {sum(v > 1.5 for v in values)},"
                  f" >2x {sum(v > 2 for v in values)}, >4x {sum(v > 4 for v in values)} of {len(values)}; median "
                  f"err / PyTorch's per tensor (highest 4): {[(n, round(m, 2)) for m, n in medians[:4]]}", flush=True)


if __name__ == "__main__":
    main()

"""The tail of ModelNew's gradient error against PyTorch's own reduced-precision reference at the smallest
training shapes (test_trimul's _check_training, repeated over fresh seeds): for each draw the worst ratio
err / PyTorch's err over the tensors past GRAD_TOLERANCE, then the distribution. Sizes the `reach` bound of
_check_training (NOTES, training). Usage: python dev/small_grad_tails.py [--draws 200] [--shapes 0,1,2]."""
import argparse
import sys

import torch

sys.path.insert(0, ".")
import test_trimul as tt  # noqa: E402
import trimul_inline as ti  # noqa: E402


def ratios(shape, direction, gate_input, dtype, draws):
    batch, n, pair_dim, hidden = shape
    found = []
    for seed in range(draws):
        g = torch.Generator().manual_seed(1000 + seed)
        reference = tt.random_layers(ti.Model(pair_dim, hidden, direction, gate_input).double(), g)
        pair, mask = tt.random_inputs(batch, n, pair_dim, g)
        reference.load_state_dict({k: v.to(dtype).double() for k, v in reference.state_dict().items()})
        new = tt._make_new(reference, dtype, None, "medium")
        pair = pair.to(dtype).double()
        grad_out = torch.randn(pair.shape, generator=g, dtype=torch.float64)
        reference, pair, mask, grad_out = reference.cuda(), pair.cuda(), mask.cuda(), grad_out.cuda()
        _, ref = tt._gradients(reference, pair, mask, grad_out)
        _, got = tt._gradients(new, pair.to(dtype), mask, grad_out)
        floor = tt._floor_gradients(reference, "medium", pair, mask, grad_out, dtype)
        worst, name_worst = 0.0, None
        for name, ref_grad in ref.items():
            err, floor_err = tt._grad_error(got[name], ref_grad), tt._grad_error(floor[name], ref_grad)
            tolerance = tt.GRAD_TOLERANCE["medium"][0 if name in ("pair_repr", "pair_mask") else 1]
            if err > tolerance and err / floor_err > worst:
                worst, name_worst = err / floor_err, name
        found.append((worst, name_worst, 1000 + seed))
    return sorted(found, reverse=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--shapes", default="0,1,2", help="indices into test_trimul.TRAINING_SHAPES")
    args = parser.parse_args()
    ti.TF32_BACKWARD_POSITIONS = 0
    for shape in (tt.TRAINING_SHAPES[int(i)] for i in args.shapes.split(",")):
        for direction in ti.DIRECTIONS:
            for dtype in (torch.bfloat16,):
                found = ratios(shape, direction, "normalized", dtype, args.draws)
                values = [r for r, _, _ in found]
                print(f"{shape} {direction} {dtype}: worst ratios {[(round(r, 1), nm, s) for r, nm, s in found[:5]]};"
                      f" >4x {sum(v > 4 for v in values)}, >16x {sum(v > 16 for v in values)},"
                      f" >32x {sum(v > 32 for v in values)} of {len(values)}", flush=True)


if __name__ == "__main__":
    main()

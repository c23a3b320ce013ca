"""Which pair_dim / hidden_dim take the fused kernels (and which kernels), per precision and input dtype, with
each one's error against fp64 and its time at N = 256 next to the reference's: issue 25's "any C and H".

    python dev/fused_coverage.py [--pair-dims 16,32,64,96,128,192,256,384,512] [--hidden 16,32,64,128,256]
"""
import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pair-dims", default="16,32,64,96,128,192,256,384,512")
    parser.add_argument("--hidden", default="16,32,64,128,256")
    parser.add_argument("--n", type=int, default=256)
    args = parser.parse_args()
    g, g_cuda = torch.Generator().manual_seed(0), torch.Generator(device="cuda").manual_seed(0)
    print(f"N = {args.n}, B = 1; time: median µs (CUDA events); error: ||out - fp64|| / ||fp64||")
    print(f"{'C':>4} {'H':>4} {'precision':>9} {'dtype':>9}  {'input':<13} {'contract':<15} {'output':<13} "
          f"{'error':>8} {'us':>8} {'ref us':>8}")
    for c in (int(x) for x in args.pair_dims.split(",")):
        for h in (int(x) for x in args.hidden.split(",")):
            reference = bench.randomize(ti.Model(c, h, "outgoing", "normalized"), g).cuda()
            pair, mask = bench.make_inputs(1, args.n, c, g_cuda, "cuda")
            with torch.no_grad():
                expected = reference.double()(pair.double(), mask)
                reference.float()
                ref_us = bench.time_cuda(lambda: reference(pair, mask), budget_s=0.05)[0]
            for precision, dtype in (("highest", torch.float32), ("high", torch.float32),
                                     ("medium", torch.float32), ("medium", torch.bfloat16)):
                model = ti.ModelNew(c, h, "outgoing", "normalized", precision=precision).cuda()
                model.load_state_dict(reference.state_dict())
                model = model.to(dtype)
                x = pair.to(dtype)
                try:
                    plan = model.forward_steps(x, mask).plan
                    kernels = (plan["input"], plan["contract"], plan["output"])
                except ValueError:
                    kernels = ("unfused", "", "")
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    error = bench.relative_error(model(x, mask), expected)
                    us = bench.time_cuda(lambda: model(x, mask), budget_s=0.05)[0]
                print(f"{c:>4} {h:>4} {precision:>9} {str(dtype)[6:]:>9}  {kernels[0]:<13} {kernels[1]:<15} "
                      f"{kernels[2]:<13} {error:>8.1e} {us:>8.1f} {ref_us:>8.1f}")


if __name__ == "__main__":
    main()

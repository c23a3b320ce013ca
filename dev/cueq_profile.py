"""cuEquivariance's bf16 training step by kernel, beside ours with bf16 parameters (bench.py --backward's
step: forward, out.float().square().mean(), backward; normalized gate), so that what each spends on which
part can be compared kernel by kernel (the loss's own kernels are the same in both):

    PYTHONPATH=<cuequivariance's site>:. python dev/cueq_profile.py [--shape 1,768,128,128] [--rows 30]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from dev.backward_profile import print_kernels  # noqa: E402

CASE = argparse.Namespace(direction="outgoing", gate_input="normalized")  # (bench.seeded_case's, as cuEq gates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=bench.parse_shapes, default=bench.parse_shapes("1,768,128,128"))
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    ref, pair, mask = bench.seeded_case(args.shape[0], CASE, 0)
    bf16 = torch.bfloat16
    leaf = pair.to(bf16).requires_grad_(True)
    if bench.cuequivariance() is not None:
        print_kernels(bench.training_step(bench.trainable_cueq(ref, bf16), leaf, mask.to(bf16)), "cueq-bf16",
                      args.rows)
    else:
        print("cuequivariance_torch does not import here: ours only")
    ours = bench.trainable_module(bench.make_model_new(ref).to(bf16))
    print_kernels(bench.training_step(ours, leaf, mask), "new-bf16", args.rows)


if __name__ == "__main__":
    main()

"""The forward with its contraction as the default order picks it against named contraction kernels, bf16
in/out: median µs per call, the plan's pick (which bench.py's `--contenders new-bf16 --kernels auto,bmm` rows
do not print), and each output's difference from the first named kernel's.

    python dev/contract_ab.py [--kernels wgmma_tma,bmm] [--shapes 1,768,128,128;...]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402

CASE = argparse.Namespace(direction="outgoing", gate_input="normalized")  # (bench.seeded_case's)

SHAPES = ("1,128,128,128;2,256,128,128;1,512,128,128;1,768,128,128;1,1024,128,128;1,1536,128,128;"
          "1,2048,128,128;2,256,384,128;1,768,384,128;1,1024,384,128")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", default="wgmma_tma,bmm")
    parser.add_argument("--shapes", type=bench.parse_shapes, default=bench.parse_shapes(SHAPES))
    parser.add_argument("--budget", type=float, default=0.1)
    args = parser.parse_args()
    bf16 = torch.bfloat16
    for batch, n, pair_dim, hidden in args.shapes:
        ref, pair, mask = bench.seeded_case((batch, n, pair_dim, hidden), CASE, 0)
        pair = pair.to(bf16)
        cells, outputs = [], []
        for kernel in [None] + args.kernels.split(","):
            model = bench.make_model_new(ref, kernels=None if kernel is None else {"contract": kernel}).to(bf16)
            with torch.no_grad():
                outputs.append(model(pair, mask).float())
                median = bench.time_cuda(lambda: model(pair, mask), budget_s=args.budget)[0]
                picked = model.forward_steps(pair, mask).plan["contract"]
            cells.append(f"{kernel or 'auto'}({picked}) {median:8.1f}")
        first = outputs[1]
        diff = max((o - first).norm().item() / first.norm().item() for o in outputs)
        print(f"{batch},{n},{pair_dim},{hidden}  " + "  ".join(cells) + f"  max rel diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()

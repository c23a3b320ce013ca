"""The training step (bf16, or fp32 at "medium") with the output pass's gate on x_hat (a raw gate, out_gate folded with LayerNorm_in's
affine: trimul_inline._gate_reads_x_hat) against the normalized gate in the pass, one process, same inputs.

    python dev/gate_x_hat_ab.py [--shapes "1,1024,384,128;1,768,384,128;2,256,384,128"] [--medium]

--medium: fp32 parameters and inputs at "medium" (the gate on bf16 x_hat rows, out in fp32), else bf16 ones.

Per shape and rule: the output pass's CUDA time (the kernels named output_pass), the step's median CUDA-event time
(bench.py's time_cuda), and the training forward's output against the other rule's.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402
from dev.backward_profile import step_kernel_events  # noqa: E402

CASE = argparse.Namespace(direction="outgoing", gate_input="normalized")  # (bench.seeded_case's)
RULES = {"pass": lambda *args: False, "x_hat": ti._gate_reads_x_hat}  # (never / the committed rule)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=bench.parse_shapes,
                        default=bench.parse_shapes("1,1024,384,128;1,768,384,128;2,256,384,128"))
    parser.add_argument("--medium", action="store_true")
    args = parser.parse_args()
    dtype = torch.float32 if args.medium else torch.bfloat16
    for shape in args.shapes:
        ref, pair, mask = bench.seeded_case(shape, CASE, 0)
        model = bench.make_model_new(ref, precision="medium").to(dtype)
        leaf = pair.to(dtype).requires_grad_(True)
        step = bench.training_step(bench.trainable_module(model), leaf, mask)
        outs = {}
        for name, rule in RULES.items():
            ti._gate_reads_x_hat = rule
            outs[name] = model(leaf, mask).detach()
            output_us = sum(e.device_time_total for e in step_kernel_events(step) if "output_pass" in e.key)
            median, p10, p90, _ = bench.time_cuda(step)
            print(f"{shape} gate {name:6s}: output pass {output_us:8.1f} us, step {median:8.0f} us "
                  f"({p10:.0f}-{p90:.0f})", flush=True)
        diff = bench.relative_error(outs["x_hat"], outs["pass"].double())
        print(f"{shape}: training forward outputs differ by {diff:.2e} (relative)", flush=True)


if __name__ == "__main__":
    main()

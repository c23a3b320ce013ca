"""The bf16 training step with the output pass's gate on x_hat (a raw gate, out_gate folded with LayerNorm_in's
affine: trimul_inline._gate_reads_x_hat) against the normalized gate in the pass, one process, same inputs.

    python dev/gate_x_hat_ab.py [--shapes "1,1024,384,128;1,768,384,128;2,256,384,128;1,768,128,128"]

Per shape and rule: the output pass's CUDA time (torch.profiler, the kernels named output_pass), the step's median
CUDA-event time over --steps back-to-back steps, and the training forward's output against the other rule's.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402

RULES = {"pass": 1 << 30, "x_hat": 0}  # GATE_FROM_X_HAT_MIN_PAIR_DIM: never / at every pair_dim


def output_pass_us(step) -> float:
    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if "output_pass" in e.key)


def step_us(step, steps: int) -> float:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for _ in range(3):
        step()
    for begin, end in events:
        begin.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return sorted(b.elapsed_time(e) for b, e in events)[steps // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1,1024,384,128;1,768,384,128;2,256,384,128;1,768,128,128")
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    for shape in args.shapes.split(";"):
        batch, n, pair_dim, hidden = (int(x) for x in shape.split(","))
        torch.manual_seed(0)
        model = ti.ModelNew(pair_dim, hidden, gate_input="normalized").cuda().to(torch.bfloat16)
        pair = torch.randn(batch, n, n, pair_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        mask = torch.rand(batch, n, n, device="cuda") > 0.1
        outs = {}

        def step():
            model.zero_grad(set_to_none=True)
            pair.grad = None
            model(pair, mask).float().square().mean().backward()

        for name, bound in RULES.items():
            ti.GATE_FROM_X_HAT_MIN_PAIR_DIM = bound
            outs[name] = model(pair, mask).detach()
            print(f"{shape} gate {name:6s}: output pass {output_pass_us(step):8.1f} us, step {step_us(step, args.steps):8.0f} us",
                  flush=True)
        diff = ((outs["x_hat"].double() - outs["pass"].double()).norm() / outs["pass"].double().norm()).item()
        print(f"{shape}: training forward outputs differ by {diff:.2e} (relative)", flush=True)


if __name__ == "__main__":
    main()

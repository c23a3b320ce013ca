"""Per-kernel CUDA time of one ModelNew training step (forward, loss, backward), by torch.profiler.

    python dev/backward_profile.py --shape 1,1024,128,128 --precision medium [--gate-input normalized]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,1024,128,128")
    parser.add_argument("--precision", default="medium")
    parser.add_argument("--gate-input", default="normalized")
    parser.add_argument("--kernels", default=None)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    batch, n, pair_dim, hidden = (int(x) for x in args.shape.split(","))
    model = ti.ModelNew(pair_dim, hidden, gate_input=args.gate_input, precision=args.precision,
                        kernels=args.kernels).cuda()
    pair = torch.randn(batch, n, n, pair_dim, device="cuda", requires_grad=True)
    mask = torch.rand(batch, n, n, device="cuda") > 0.1

    def step():
        model.zero_grad(set_to_none=True)
        pair.grad = None
        model(pair, mask).float().square().mean().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events)
    print(f"{args.shape} {args.precision} {args.gate_input}: {total:.0f} us of CUDA time in {len(events)} kernels")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:args.rows]:
        print(f"{e.device_time_total:9.1f} us  {e.count:3d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()

"""Where a training step's pair-sized device copy comes from: the CUDA time under each autograd node and under
the ops that copy (clone, contiguous, copy_), by input shape; then, with hooks, whether grad_out reaches the
op contiguous and whether autograd kept the backward's d pair as pair.grad or copied it.

    python dev/step_copies.py --shape 1,512,128,128 [--precision medium]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,512,128,128")
    parser.add_argument("--precision", default="medium")
    args = parser.parse_args()
    batch, n, pair_dim, hidden = (int(x) for x in args.shape.split(","))
    model = ti.ModelNew(pair_dim, hidden, gate_input="normalized", precision=args.precision).cuda()
    pair = torch.randn(batch, n, n, pair_dim, device="cuda", requires_grad=True)
    mask = torch.rand(batch, n, n, device="cuda") > 0.1

    def step(hooks=None):
        model.zero_grad(set_to_none=True)
        pair.grad = None
        out = model(pair, mask)
        handles = [out.register_hook(hooks[0]), pair.register_hook(hooks[1])] if hooks else []
        out.float().square().mean().backward()
        for h in handles:
            h.remove()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    print(f"{args.shape} {args.precision}: CUDA time under autograd nodes and copying ops (us, count, shapes):")
    for e in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.device_time_total):
        if e.device_time_total > 5 and ("evaluate_function" in e.key or e.key in
                                        ("aten::clone", "aten::contiguous", "aten::copy_", "aten::to", "aten::_to_copy")):
            print(f"{e.device_time_total:9.1f} us {e.count:3d}x {e.key[:90]} {str(e.input_shapes)[:120]}")

    seen = {}
    step((lambda g: seen.__setitem__("grad_out", (g.is_contiguous(), g.stride())),
          lambda g: seen.__setitem__("d_pair", (g.data_ptr(), g._is_view(), g.is_contiguous()))))
    torch.cuda.synchronize()
    ptr, is_view, contiguous = seen["d_pair"]
    print(f"grad_out at the op: contiguous {seen['grad_out'][0]}, strides {seen['grad_out'][1]}")
    print(f"d pair: a view {is_view}, contiguous {contiguous}; pair.grad "
          f"{'is d pair (kept)' if pair.grad.data_ptr() == ptr else 'a copy of d pair'}")


if __name__ == "__main__":
    main()

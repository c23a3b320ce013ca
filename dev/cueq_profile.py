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
import trimul_inline as ti  # noqa: E402


def profile(name, trainable, pair, mask, rows):
    """Prints one step's CUDA kernels (after three warm-up steps) by total time."""
    step = bench.training_step(trainable, pair, mask)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events)
    print(f"{name}: {total:.0f} us of CUDA time in {len(events)} kernels")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:rows]:
        print(f"{e.device_time_total:9.1f} us  {e.count:3d}x  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,768,128,128")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    batch, n, pair_dim, hidden = (int(x) for x in args.shape.split(","))
    generator = torch.Generator(device="cuda").manual_seed(0)
    ref = bench.randomize(ti.Model(pair_dim, hidden, "outgoing", "normalized").cuda(), generator)
    pair, mask = bench.make_inputs(batch, n, pair_dim, generator, "cuda")
    bf16 = torch.bfloat16
    leaf = pair.to(bf16).requires_grad_(True)
    if bench.cuequivariance() is not None:
        profile("cueq-bf16", bench.trainable_cueq(ref, bf16), leaf, mask.to(bf16), args.rows)
    else:
        print("cuequivariance_torch does not import here: ours only")
    ours = bench.trainable_module(bench.make_model_new(ref).to(bf16))
    profile("new-bf16", ours, leaf, mask, args.rows)


if __name__ == "__main__":
    main()

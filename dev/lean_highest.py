"""The "highest" training step with backward_saves="z" (the lean backward: proj recomputed before d_proj, so the
[P, 4H] fp32 proj is not held across the output side and the contraction's backward) against the default, one
process: median µs and the step's peak above its start. `PYTHONPATH=. python dev/lean_highest.py "1,1024,128,128"`."""
import sys
import torch
import bench

for shape in [tuple(int(v) for v in s.split(",")) for s in sys.argv[1].split(";")]:
    args = type("A", (), {"direction": "outgoing", "gate_input": "normalized"})
    ref, pair, mask = bench.seeded_case(shape, args, 0)
    pair = pair.requires_grad_(True)
    for saves in (None, "z", None):
        model = bench.make_model_new(ref, precision="highest")
        model.backward_saves = saves
        trainable = bench.trainable_module(model)
        step = bench.training_step(trainable, pair, mask)
        step()
        median, low, high, _ = bench.time_cuda(step, budget_s=0.3)
        bench.clear_gradients(trainable, pair)
        print(f"{shape} backward_saves={saves}: {median:.0f} us ({low:.0f}-{high:.0f}), peak "
              f"{bench.peak_memory_mib(step):.0f} MiB", flush=True)

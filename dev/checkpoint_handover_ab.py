"""The bf16 training step under torch.utils.checkpoint (non-reentrant), with the recompute's kept buffers handed to
the backward (the committed path) against the path before it (nothing kept under checkpoint's hooks: the backward
recomputes z and the a/b planes), in one process, by patching _checkpoint_hooks_active. Session 44 measured it:
`PYTHONPATH=. python dev/checkpoint_handover_ab.py "1,1024,128,128;1,768,384,128;1,2048,128,128"`."""
import sys
import torch
import bench
import trimul_inline as ti

shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[1].split(";")]
handed = ti._checkpoint_hooks_active
for shape in shapes:
    args = type("A", (), {"direction": "outgoing", "gate_input": "normalized"})
    ref, pair, mask = bench.seeded_case(shape, args, 0)
    model = bench.make_model_new(ref).to(torch.bfloat16)
    pair = pair.to(torch.bfloat16).requires_grad_(True)
    for label, hooks in (("handed", handed), ("before", lambda: False), ("handed", handed)):
        ti._checkpoint_hooks_active = hooks
        trainable = bench.checkpointed_trainable(model)
        step = bench.training_step(trainable, pair, mask)
        step()
        median, low, high, reps = bench.time_cuda(step, budget_s=0.3)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"{shape} {label}: {median:.0f} us ({low:.0f}-{high:.0f}), peak {peak:.0f} MiB", flush=True)

"""Whether ncu's "sent to the L2 compression unit" count marks a kernel or every store (bench/NOTES.md,
open question 4 of "Training"): a plain PyTorch elementwise kernel (y = x * 2, 1 GiB) and one fused forward (N = 2048
bf16, normalized gate), to run under ncu's memory tables. If the plain kernel's written sectors are
counted as compression input too, the count is every store's path and the lead is nothing.

    ncu --section MemoryWorkloadAnalysis_Tables -k regex:"elementwise|output" python dev/l2_compression_probe.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402


def main() -> None:
    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    y = x * 2  # (a kernel: a same-dtype copy_ is a memcpy, which ncu does not profile)
    torch.cuda.synchronize()
    model = ti.ModelNew(128, 128, gate_input="normalized").cuda().to(torch.bfloat16)
    pair = torch.randn(1, 2048, 2048, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(1, 2048, 2048, device="cuda") > 0.05
    with torch.inference_mode():
        model(pair, mask)
    torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()

"""Whether ncu's "sent to the L2 compression unit" count marks a kernel or every store (bench/NOTES.md,
open question 4 of "Training"): a plain PyTorch copy (y.copy_(x), 1 GiB) and one fused forward (N = 2048
bf16, normalized gate), to run under ncu with the lts__gcomp metrics. If the copy's written sectors are
counted as compression input too, the count is every store's path and the lead is nothing.

    ncu --metrics <lts__gcomp...> python dev/l2_compression_probe.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402


def main() -> None:
    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    model = ti.ModelNew(128, 128, gate_input="normalized").cuda()
    pair = torch.randn(1, 2048, 2048, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(1, 2048, 2048, device="cuda") > 0.05
    with torch.inference_mode():
        model(pair, mask)
    torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()

"""Which bf16 rounding dominates the backward's d pair_repr error? CPU emulation of training_backward's
bf16 path (products with fp32 accumulation, as cuBLAS), one intermediate at a time kept in fp32.

    python dev/bf16_rounding.py        # CPU only, about a minute
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import trimul_inline as ti  # noqa: E402

torch.manual_seed(0)
B, N, C, H = 1, 48, 128, 128
g = torch.Generator().manual_seed(1)
ref = bench.randomize(ti.Model(C, H, "outgoing", "normalized"), g).double()
pair, mask = bench.make_inputs(B, N, C, g, "cpu")
pair = pair.double()
grad_out = torch.randn(pair.shape, generator=g, dtype=torch.float64)
p = pair.clone().requires_grad_()
ref(p, mask).backward(grad_out)
params = ti._param_list(ref)
ref_grads = [p.grad, None] + [q.grad for q in params]
names = ["pair", "mask"] + [f"{a}.{b}" for a, b in ti._PARAM_PATHS]

# products: bf16 operands, fp32 accumulation, out in the requested dtype
class P:
    @staticmethod
    def mm(x, y, out_dtype): return (x.float() @ y.float()).to(out_dtype)
    @staticmethod
    def bmm(x, y): return (x.float() @ y.float()).to(x.dtype)
    @staticmethod
    def add_mm_(total, x, y): total += (x.float() @ y.float()).to(total.dtype)
    @staticmethod
    def linear(rows, w, b): return (rows.float() @ w.float().t().to(rows.dtype).float() + b.float()).to(rows.dtype)
ti._Products = P

def run(keep=()):
    """fp32 pair/params (medium), the backward with dtype bf16 except the intermediates named in keep."""
    orig = dict(ti._TorchBackwardPasses.__dict__)
    T = ti._TorchBackwardPasses
    def dt(name, d): return torch.float32 if name in keep else d
    class K(T):
        @staticmethod
        def input_rows(pair_rows, eps, dtype): return T.input_rows(pair_rows, eps, dt("x_hat", dtype))
        @staticmethod
        def gated_planes(proj, m, b, n, inc):
            a_, b_ = T.gated_planes(proj.float() if "proj" in keep else proj, m, b, n, inc)
            return (a_.float(), b_.float()) if "ab" in keep else (a_.to(torch.bfloat16), b_.to(torch.bfloat16))
        @staticmethod
        def z_rows(z, b, n, eps, dtype): return T.z_rows(z, b, n, eps, dt("z_hat", dtype))
        @staticmethod
        def gate_grad(d_out, o, gp):
            r = T.gate_grad(d_out, o.float(), gp.float())
            return (r[0].to(dt("d_o", torch.bfloat16)), r[1].to(dt("d_gate", torch.bfloat16)), r[2], r[3])
        @staticmethod
        def dz_planes(dzh, zh, rstd, b, n, dtype): return T.dz_planes(dzh, zh, rstd, b, n, dt("dz", dtype))
        @staticmethod
        def d_proj(proj, da, db, m, b, n, inc, mg):
            r = T.d_proj(proj.float() if "proj" in keep else proj, da.float() if "dab" in keep else da, db.float() if "dab" in keep else db, m, b, n, inc, mg)
            return (r[0].to(dt("d_proj", torch.bfloat16)), r[1], r[2])
    ti._backward_passes = lambda *a, **k: K
    # z: the recomputed product in bf16 unless kept
    grads = ti.training_backward(grad_out.float(), pair.float(), mask, [q.float() for q in params], ti.Kernels(),
                                 "bf16", False, True, 1e-5, 1e-5, False)
    return {n_: ((a.double() - r).norm() / r.norm()).item() for n_, a, r in zip(names, grads, ref_grads) if r is not None}

base = run()
print("all bf16:   pair %.2e  worst param %.2e (%s)" % (base["pair"], max(v for k, v in base.items() if k != "pair"), max(((v, k) for k, v in base.items() if k != "pair"))[1]))
for keep in ["x_hat", "proj", "ab", "z_hat", "d_o", "d_gate", "dz", "dab", "d_proj"]:
    e = run((keep,))
    print(f"keep {keep:7s}: pair {e['pair']:.2e}  worst param {max(v for k, v in e.items() if k != 'pair'):.2e}")
e = run(("x_hat", "proj", "ab", "z_hat", "d_o", "d_gate", "dz", "dab", "d_proj"))
print(f"keep all   : pair {e['pair']:.2e}  worst param {max(v for k, v in e.items() if k != 'pair'):.2e}")

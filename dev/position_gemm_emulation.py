"""CPU checks of the position_gemm kernels' layouts and of wgmma_f16x3's arithmetic (dev/position_gemm_*.diff),
for editing them without a GPU:

    python dev/position_gemm_emulation.py

1. Index consistency: each kernel's fragment loads (the row chunks a thread reads from a TMA box with the 128-byte
   swizzle, the weight's k permutation `slot_k`, the weight-gradient kernel's d columns and transposed x tile)
   against wgmma's documented register-A layouts (tf32 m64k8, f16 m64k16) and its K-major B layout. The tf32 rows
   kernel, measured correct on the H200, is the control. The formulas are copied from the kernels: change them here
   when a kernel's change.
2. wgmma_f16x3's arithmetic in torch on the CPU (the power-of-two scales, fp16 parts, per-64-k promotion; fp32
   sums rounded to nearest where the tensor cores truncate) against fp64, beside fp32 and a tf32x3 emulation, and on
   rows and weights spanning wide ranges (test_position_gemm_scales_wide_ranges' data).
"""
import sys

import torch

failures = 0
def slot_k_tf32(q):
    j, l = q >> 3, q & 7
    return 8 * l + 2 * j if l < 4 else 8 * (l - 4) + 2 * j + 1

def slot_k_f16(q):
    j, l = q >> 4, q & 15
    t = (l & 7) >> 1
    i = 4 * j + (l & 1) + (2 if l >= 8 else 0)
    return 8 * t + i if i < 8 else 32 + 8 * t + (i - 8)

assert sorted(slot_k_tf32(q) for q in range(32)) == list(range(32))
assert sorted(slot_k_f16(q) for q in range(64)) == list(range(64))

def logical_col_of_box_read(g, chunk_code, lane_in_chunk):
    # the kernel reads chunk (code ^ g) of a row r with r % 8 == g; TMA SW128 stored logical chunk c at c ^ (r % 8)
    physical = chunk_code ^ g
    logical_chunk = physical ^ g
    return 4 * logical_chunk + lane_in_chunk

# ---- tf32 rows kernel (validated on the GPU: the control) ---
bad = 0
for g in range(8):
    for t in range(4):
        row0 = [logical_col_of_box_read(g, 2 * t, e) for e in range(4)] + [logical_col_of_box_read(g, 2 * t + 1, e) for e in range(4)]
        for j in range(4):
            # hi[j][0] = row0[2j] is a0 (k t of step j): B slot 8j + t must hold that element
            if slot_k_tf32(8 * j + t) != row0[2 * j]: bad += 1
            if slot_k_tf32(8 * j + t + 4) != row0[2 * j + 1]: bad += 1
print("tf32 rows fragments:", "ok" if bad == 0 else f"{bad} mismatches")
failures += bad

# ---- f16 rows kernel ---
bad = 0
for g in range(8):
    for t in range(4):
        v = [logical_col_of_box_read(g, 2 * t, e) for e in range(4)] + [logical_col_of_box_read(g, 2 * t + 1, e) for e in range(4)]
        v += [32 + c for c in v]  # box 1 (k 32-63), same chunks
        for j in range(4):
            # split_pair(v[4j], v[4j+1]) -> a0/a1 (k 2t, 2t+1); split_pair(v[4j+2], v[4j+3]) -> a2/a3 (k 2t+8, 2t+9)
            for e in range(2):
                if slot_k_f16(16 * j + 2 * t + e) != v[4 * j + e]: bad += 1
                if slot_k_f16(16 * j + 2 * t + 8 + e) != v[4 * j + 2 + e]: bad += 1
print("f16 rows fragments:", "ok" if bad == 0 else f"{bad} mismatches")
failures += bad

# ---- tf32 weight-gradient kernel: A[m][k] = d[position k][column m], B K-major [n][positions] written by threads ---
# load_grad_fragments: box = 2wg + (w4 >> 1), m0 = 16 (w4 & 1) + g (column in the box); at(p, m) reads row p, chunk
# (m >> 2) ^ (p & 7), lane m & 3: with TMA's SW128 that is logical (p, m) of the box.
bad = 0
for wg in range(2):
    for w4 in range(4):
        for g in range(8):
            for t in range(4):
                box = 2 * wg + (w4 >> 1)
                m_local = 16 * (w4 & 1) + g
                col = 32 * box + m_local           # the d column read
                want_row = 64 * wg + 16 * w4 + g    # the A row (m) this thread's a0 holds
                if col != want_row: bad += 1  # (and m0 + 8: the row 8 further, a1 and a3)
                # (a0 and a2 hold positions 8j + t and 8j + t + 4 of step j: B's slot 8j + k is position 8j + k, no
                # permutation, as the B tile check below finds)
print("tf32 grad A rows:", "ok" if bad == 0 else f"{bad} mismatches")
failures += bad

# split_b_tile: unit -> (n, c): reads x box (n >> 5) at row p = 4c + e, chunk ((n & 31) >> 2) ^ (p & 7), lane n & 3:
# logical (p, n & 31) of box n >> 5 = x[p][n]; writes 16-byte chunk (c ^ (n & 7)) of row n: with the hardware's
# SW128 K-major read (logical 16-byte chunk c of row n at c ^ (n & 7)) B[k = 4c + e][n] = x[4c + e][n].
bad = 0
for unit in range(1024):
    n, c = unit & 127, unit >> 7
    for e in range(4):
        p = 4 * c + e
        physical_chunk_read = ((n & 31) >> 2) ^ (p & 7)
        logical_col = 4 * (physical_chunk_read ^ (p & 7)) + (n & 3) + 32 * (n >> 5)
        if logical_col != n: bad += 1
        written_physical = c ^ (n & 7)
        logical_k = 4 * (written_physical ^ (n & 7)) + e
        if logical_k != p: bad += 1
print("tf32 grad B tile:", "ok" if bad == 0 else f"{bad} mismatches")
failures += bad
# ---- f16 weight-gradient kernel: split_b_f16 (two lanes a column, positions 8c + 4u + e; 8-byte stores at chunk
# c ^ (n & 7), byte 8u) and load_grad_fragments (d column 32 box + m, positions 16j + 2t (+1, +8, +9))
bad = 0
for w in range(8):
    for lane in range(32):
        n, u = 16 * w + (lane >> 1), lane & 1
        for c in range(8):
            for e in range(4):
                p = 8 * c + 4 * u + e
                read_chunk = ((n & 31) >> 2) ^ (p & 7)
                if 4 * (read_chunk ^ (p & 7)) + (n & 3) + 32 * (n >> 5) != n: bad += 1
                byte = 16 * ((c ^ (n & 7)) ^ (n & 7)) + 8 * u + 2 * e  # (the hardware's logical byte of that half)
                if byte // 2 != p: bad += 1
for wg in range(2):
    for w4 in range(4):
        for g in range(8):
            for r8 in range(2):
                if 32 * (2 * wg + (w4 >> 1)) + 16 * (w4 & 1) + g + 8 * r8 != 64 * wg + 16 * w4 + g + 8 * r8: bad += 1
print("f16 grad B tile and A columns:", "ok" if bad == 0 else f"{bad} mismatches")
failures += bad

torch.manual_seed(0)


def scale_for(largest):  # tensor of maxima -> (s, inv) per the kernel's exponent arithmetic
    e = ((largest.view(torch.int32) >> 23) & 0xff).clamp(min=15)
    s = ((268 - e) << 23).view(torch.float32)
    inv = ((e - 14) << 23).view(torch.float32)
    return s, inv
def parts(x):
    hi = x.half()
    lo = (x - hi.float()).half()
    return hi, lo
def f16x3(rows, w, bias):
    m, k = rows.shape
    n = w.shape[0]
    kp = (k + 63) // 64 * 64
    rows = torch.nn.functional.pad(rows, (0, kp - k)); w = torch.nn.functional.pad(w, (0, kp - k))
    s_w, inv_w = scale_for(w.abs().amax(1).float())
    whi, wlo = parts(w * s_w[:, None])
    total = torch.zeros(m, n)
    for kt in range(kp // 64):
        x = rows[:, 64 * kt: 64 * kt + 64]
        s, inv = scale_for(x.abs().amax(1))
        xhi, xlo = parts(x * s[:, None])
        sl = slice(64 * kt, 64 * kt + 64)
        acc = (xlo.float() @ whi[:, sl].float().t()) + (xhi.float() @ wlo[:, sl].float().t()) + (xhi.float() @ whi[:, sl].float().t())
        total += acc * inv[:, None]
    return total * inv_w[None, :] + bias
def tf32(x): return (x.view(torch.int32) + 0x1000 & ~0x1fff).view(torch.float32)  # round to nearest-ish (rna)
def tf32x3(rows, w, bias):
    k = rows.shape[1]; total = 0
    for kt in range(0, k, 32):
        x = rows[:, kt:kt+32]; ww = w[:, kt:kt+32]
        xh = tf32(x); xl = tf32(x - xh); wh = tf32(ww); wl = tf32(ww - wh)
        total = total + (xl @ wh.t() + xh @ wl.t() + xh @ wh.t())
    return total + bias
for k, n in [(128, 128), (384, 512), (896, 384), (640, 128)]:
    rows = torch.randn(8192, k)
    w = torch.randn(n, k) / k ** 0.5
    b = torch.randn(n)
    ref = rows.double() @ w.double().t() + b.double()
    rel = lambda o: ((o.double() - ref).norm() / ref.norm()).item()
    print(f"K={k} N={n}: fp32 {rel(rows @ w.t() + b):.2e}  f16x3 {rel(f16x3(rows, w, b)):.2e}  tf32x3 {rel(tf32x3(rows, w, b)):.2e}")
# the weight gradients' scales: d's and x's columns per 64-position tile
def f16x3_grad(d, x):
    total = torch.zeros(d.shape[1], x.shape[1])
    for p0 in range(0, d.shape[0], 64):
        dt, xt = d[p0:p0 + 64], x[p0:p0 + 64]
        s_d, inv_d = scale_for(dt.abs().amax(0))
        s_x, inv_x = scale_for(xt.abs().amax(0))
        dh, dl = parts(dt * s_d)
        xh, xl = parts(xt * s_x)
        acc = dl.float().t() @ xh.float() + dh.float().t() @ xl.float() + dh.float().t() @ xh.float()
        total += acc * inv_d[:, None] * inv_x[None, :]
    return total
d = torch.randn(8192, 200) * 0.1 * torch.exp2(torch.randint(-20, 21, (200,)).float())
x = (torch.randn(8192, 130) * 2 + 0.3) * torch.exp2(torch.randint(-20, 21, (130,)).float())
unscale = (d.abs().amax(0).double()[:, None] * x.abs().amax(0).double()[None, :])
ref = d.double().t() @ x.double()
rel = lambda o: (((o.double() - ref) / unscale).norm() / (ref / unscale).norm()).item()
print(f"weight gradient, wide columns: fp32 {rel(d.t() @ x):.2e}  f16x3 {rel(f16x3_grad(d, x)):.2e}")
# wide ranges
m, k, n = 515, 200, 140
rows = torch.randn(m, k, dtype=torch.float64) * torch.exp2(torch.randint(-60, 61, (m, k)).double())
w = torch.randn(n, k, dtype=torch.float64) * torch.exp2(torch.randint(-20, 21, (n, k)).double())
rows[4] *= 1e20 / rows[4].abs().max(); rows[5] *= 1e-20 / rows[5].abs().max()
rows, w = rows.float(), w.float()
ref = rows.double() @ w.double().t()
out = f16x3(rows, w, torch.zeros(n)); cub = rows @ w.t()
worst = max((((out[i].double() - ref[i]).norm() / ref[i].norm()).item() / max(3 * ((cub[i].double() - ref[i]).norm() / ref[i].norm()).item(), 5e-7)) for i in range(m))
print("wide ranges: worst err / bound", worst)
if worst > 1:
    failures += 1
sys.exit(1 if failures else 0)

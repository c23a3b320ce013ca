"""dev/split_f16x3_emulation.py — contract_backward's wgmma_f16x3 on the CPU: the split pass
(kernels/contract_backward_wgmma_f16x3.cu, split_kernel) emulated block by block with its own index
arithmetic, then the products as wgmma_tma's split path computes them (part.part + part.rem + rem.part in fp32,
times unscale per plane), against fp64. Checks the index math and the error before any GPU run.

    python dev/split_f16x3_emulation.py
"""
import math
import struct

import torch

K_SIDE = 64


def scale_exponent(bound: float) -> int:
    """fused::exponent_to_4096: from the float's biased exponent, clamped to [-100, 100]."""
    biased = (struct.unpack("<I", struct.pack("<f", bound))[0] >> 23) & 0xFF
    return min(max(12 - (biased - 126), -100), 100)


def split(planes, bound, ld, rows=True, transposed=False, bound_other=None):
    """The pass's outputs: parts [2, batch, n, ld] (rows), parts_t (transposed), unscale [batch] (or None)."""
    batch, n = planes.shape[0], planes.shape[1]
    parts = torch.full((2, batch, n, ld), float("nan"), dtype=torch.float16) if rows else None
    parts_t = torch.full((2, batch, n, ld), float("nan"), dtype=torch.float16) if transposed else None
    unscale = torch.full((batch,), float("nan")) if bound_other is not None else None
    tiles = -(-ld // K_SIDE)
    for plane in range(batch):
        scale = math.ldexp(1.0, scale_exponent(float(bound[plane])))
        if unscale is not None:
            unscale[plane] = math.ldexp(1.0, -scale_exponent(float(bound[plane]))) * \
                math.ldexp(1.0, -scale_exponent(float(bound_other[plane])))
        for by in range(tiles):
            for bx in range(tiles):
                row0, col0 = by * K_SIDE, bx * K_SIDE
                tile = torch.zeros(K_SIDE, K_SIDE)
                r_hi, c_hi = min(n, row0 + K_SIDE), min(n, col0 + K_SIDE)
                if r_hi > row0 and c_hi > col0:
                    tile[:r_hi - row0, :c_hi - col0] = planes[plane, row0:r_hi, col0:c_hi] * scale
                for i in range(K_SIDE * K_SIDE // 2):
                    r, c = i // (K_SIDE // 2), 2 * (i % (K_SIDE // 2))
                    if rows and row0 + r < n and col0 + c < ld:
                        store(parts, plane, row0 + r, col0 + c, tile[r, c], tile[r, c + 1])
                    if transposed and col0 + r < n and row0 + c < ld:
                        store(parts_t, plane, col0 + r, row0 + c, tile[c, r], tile[c + 1, r])
    return parts, parts_t, unscale


def store(out, plane, row, col, x0, x1):
    pair = torch.stack([x0, x1]).float()
    hi = pair.half()
    out[0, plane, row, col:col + 2] = hi
    out[1, plane, row, col:col + 2] = (pair - hi.float()).half()


def product(x, y, unscale, n):
    """wgmma_tma's split path: three fp16 products with fp32 sums over k < n (the padding is zero)."""
    big_x, small_x, big_y, small_y = (t.float()[..., :n] for t in (x[0], x[1], y[0], y[1]))
    z = big_x @ big_y.transpose(1, 2) + big_x @ small_y.transpose(1, 2) + small_x @ big_y.transpose(1, 2)
    return z * unscale.view(-1, 1, 1)


def check(n, seed):
    g = torch.Generator().manual_seed(seed)
    ld = -(-max(n, 1) // 32) * 32

    def planes(scales):
        return torch.randn(len(scales), n, n, generator=g, dtype=torch.float64) * \
            torch.tensor(scales, dtype=torch.float64).view(-1, 1, 1)

    a, b, dz = planes([1.0, 1e-5, 0.0, 3e3]), planes([2e2, 1.0, 1e-4, 0.0]), planes([1e-3, 1.0, 7.0, 1.0])
    bound = {k: v.abs().amax(dim=(1, 2)).float() for k, v in dict(a=a, b=b, dz=dz).items()}
    a32, b32, dz32 = a.float(), b.float(), dz.float()
    pa, _, _ = split(a32, bound["a"], ld)
    pb, _, u0 = split(b32, bound["b"], ld, bound_other=bound["a"])
    for name, parts in (("a", pa), ("b", pb)):
        assert not parts.isnan().any(), f"{name}: unwritten parts"
        assert (parts[..., n:] == 0).all(), f"{name}: padding not zero"
    z = product(pa, pb, u0, n)
    pdz, _, _ = split(dz32, bound["dz"], ld)
    _, pbt, u1 = split(b32, bound["b"], ld, transposed=True, rows=False, bound_other=bound["dz"])
    da = product(pdz, pbt, u1, n)
    _, pdzt, _ = split(dz32, bound["dz"], ld, rows=False, transposed=True)
    _, pat, u2 = split(a32, bound["a"], ld, rows=False, transposed=True, bound_other=bound["dz"])
    db = product(pdzt, pat, u2, n)
    expected = dict(z=a @ b.transpose(1, 2), da=dz @ b, db=dz.transpose(1, 2) @ a)
    worst = 0.0
    for name, got in dict(z=z, da=da, db=db).items():
        for plane in range(4):
            ref = expected[name][plane]
            err = float((got[plane].double() - ref).norm() / ref.norm()) if ref.norm() > 0 else \
                float(got[plane].double().norm())
            assert err < 2e-6, (n, name, plane, err)
            worst = max(worst, err)
    return worst


if __name__ == "__main__":
    for n in (1, 7, 33, 70):
        print(f"N = {n}: worst plane error {check(n, 1000 + n):.2e}")

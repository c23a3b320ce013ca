"""Memory-only skeletons of the fused passes' access patterns: is the [B*H, N, ld] ("h-major")
layout of a/b and z what holds the passes near 750-850 µs at (1,1024,128,128)?

    python bench/layout_probe.py [--n 1024] [--pair-dim 128] [--hidden 128]

Each probe moves the bytes a pass moves, with no LayerNorm and no products: warps take tiles of 32
consecutive positions, as the resident passes do.
  copy            read pair, write the same bytes contiguously (the bandwidth ceiling)
  input h-major   read pair rows, write 2H bf16 values per position into 2H planes (a_t / b_t now),
                  as whole 64-byte runs per store or as the mma epilogue stores (8 planes x 16 bytes)
  input pos-major read pair rows, write the 2H values of a position contiguously
  output h-major  read H fp32 z values per position from H planes (z now) and the pair row, write
                  the C fp32 outputs of the position
  output pos-major the same with z's H values of a position contiguous
It prints µs (median of 20 CUDA-event timings after warm-up) and the bytes moved per µs. Not part
of the test suite; a diagnostic for bench/NOTES.md.
"""
import argparse
import os
import sys

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trimul_inline as ti  # noqa: E402  (the module's toolkit discovery and arch, for the same build)


CUDA_SOURCE = r"""
#include <cuda_bf16.h>
#include <cstdint>

constexpr int kTile = 32;

// Reads the tile's 32 rows of `c` floats cooperatively (coalesced) and returns one value per lane
// that depends on every load (so no load is dead).
__device__ float read_rows(const float* __restrict__ rows, int c) {
  const int lane = threadIdx.x & 31;
  const float4* v = reinterpret_cast<const float4*>(rows);
  float s = 0.f;
  for (int i = lane; i < kTile * c / 4; i += 32) {
    const float4 x = v[i];
    s += x.x + x.y + x.z + x.w;
  }
  return s;
}

// mode 0: input h-major (each store: 32 positions of one plane), 1: input position-major, 2: input
// h-major stored as the mma epilogue does (lane g, t: 2 positions 2t, 2t+1 of plane g, so one
// store covers 8 planes x 16 bytes).
__global__ void input_probe(const float* __restrict__ pair, __nv_bfloat16* __restrict__ out, int64_t positions,
                            int c, int planes, int mode) {
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
  const int64_t tiles = positions / kTile;
  for (int64_t tile = int64_t(blockIdx.x) * warps + threadIdx.x / 32; tile < tiles;
       tile += int64_t(gridDim.x) * warps) {
    const int64_t p0 = tile * kTile;
    const float s = read_rows(pair + p0 * c, c);
    if (mode == 0) {
      for (int r = 0; r < planes; r += 2) {  // two planes per step, as the epilogue's pairs
        out[int64_t(r) * positions + p0 + lane] = __float2bfloat16(s + r);
        out[int64_t(r + 1) * positions + p0 + lane] = __float2bfloat16(s - r);
      }
    } else if (mode == 1) {
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + p0 * planes);
      for (int i = lane; i < kTile * planes / 2; i += 32) dst[i] = __floats2bfloat162_rn(s + i, s - i);
    } else {
      const int g = lane >> 2, t = lane & 3;
      for (int r = 0; r < planes; r += 8)
        for (int ni = 0; ni < kTile / 8; ++ni)
          *reinterpret_cast<__nv_bfloat162*>(out + int64_t(r + g) * positions + p0 + ni * 8 + 2 * t) =
              __floats2bfloat162_rn(s + r, s - r);
    }
  }
}

// mode 0: z h-major ([H][positions]), 1: z position-major ([positions][H]).
__global__ void output_probe(const float* __restrict__ z, const float* __restrict__ pair, float* __restrict__ out,
                             int64_t positions, int c, int hidden, int mode) {
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
  const int64_t tiles = positions / kTile;
  for (int64_t tile = int64_t(blockIdx.x) * warps + threadIdx.x / 32; tile < tiles;
       tile += int64_t(gridDim.x) * warps) {
    const int64_t p0 = tile * kTile;
    float s = 0.f;
    if (mode == 0) {
      for (int h = 0; h < hidden; ++h) s += z[int64_t(h) * positions + p0 + lane];
    } else {
      s = read_rows(z + p0 * hidden, hidden);
    }
    s += read_rows(pair + p0 * c, c);
    float4* dst = reinterpret_cast<float4*>(out + p0 * c);
    for (int i = lane; i < kTile * c / 4; i += 32) dst[i] = make_float4(s, s + 1.f, s + 2.f, s + 3.f);
  }
}

__global__ void copy_probe(const float4* __restrict__ src, float4* __restrict__ dst, int64_t vectors) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

void run_input(const float* pair, void* out, int64_t positions, int c, int planes, int mode, int blocks, int threads,
               cudaStream_t stream) {
  input_probe<<<blocks, threads, 0, stream>>>(pair, static_cast<__nv_bfloat16*>(out), positions, c, planes, mode);
}
void run_output(const float* z, const float* pair, float* out, int64_t positions, int c, int hidden, int mode,
                int blocks, int threads, cudaStream_t stream) {
  output_probe<<<blocks, threads, 0, stream>>>(z, pair, out, positions, c, hidden, mode);
}
void run_copy(const float* src, float* dst, int64_t floats, int blocks, cudaStream_t stream) {
  copy_probe<<<blocks, 256, 0, stream>>>(reinterpret_cast<const float4*>(src), reinterpret_cast<float4*>(dst),
                                         floats / 4);
}
"""

CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
void run_input(const float*, void*, int64_t, int, int, int, int, int, cudaStream_t);
void run_output(const float*, const float*, float*, int64_t, int, int, int, int, int, cudaStream_t);
void run_copy(const float*, float*, int64_t, int, cudaStream_t);

void input(torch::Tensor pair, torch::Tensor out, int64_t planes, int64_t mode, int64_t blocks, int64_t threads) {
  run_input(pair.data_ptr<float>(), out.data_ptr(), pair.size(0), pair.size(1), planes, mode, blocks, threads,
            c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
void output(torch::Tensor z, torch::Tensor pair, torch::Tensor out, int64_t hidden, int64_t mode, int64_t blocks,
            int64_t threads) {
  run_output(z.data_ptr<float>(), pair.data_ptr<float>(), out.data_ptr<float>(), pair.size(0), pair.size(1),
             hidden, mode, blocks, threads, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
// A buffer straight from cudaMalloc (never compressible), to compare with the caching allocator's:
// profile 7 saw the input pass's a/b stores go through the L2 compression unit.
torch::Tensor raw_buffer(int64_t bytes) {
  void* ptr = nullptr;
  TORCH_CHECK(cudaMalloc(&ptr, bytes) == cudaSuccess, "cudaMalloc of ", bytes, " bytes failed");
  return torch::from_blob(ptr, {bytes}, [](void* p) { cudaFree(p); },
                          torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
}
void copy(torch::Tensor src, torch::Tensor dst, int64_t blocks) {
  run_copy(src.data_ptr<float>(), dst.data_ptr<float>(), src.numel(), blocks, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


def build():
    toolkit, arch = ti.find_toolkit(), ti.target_arch()
    with ti._torch_cuda_home(toolkit.home):
        return load_inline("trimul_layout_probe", cpp_sources=CPP_SOURCE, cuda_sources=CUDA_SOURCE,
                           functions=["input", "output", "copy", "raw_buffer"],
                           extra_cflags=[f"-idirafter{d}" for d in toolkit.extra_includes],
                           extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
                           extra_ldflags=[f"-L{d}" for d in toolkit.extra_lib_dirs])


def time_us(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--pair-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("layout_probe: needs a CUDA device")
        return 1
    module = build()
    positions, c, hidden = args.n * args.n, args.pair_dim, args.hidden
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pair = torch.randn(positions, c, device="cuda")
    out_ab = torch.empty(2 * hidden * positions, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(hidden * positions, device="cuda")
    out = torch.empty(positions, c, device="cuda")
    copy_dst = torch.empty_like(pair)
    pair_bytes, ab_bytes, z_bytes = pair.numel() * 4, out_ab.numel() * 2, z.numel() * 4
    rows = [("copy (pair -> contiguous)", 2 * pair_bytes, lambda: module.copy(pair, copy_dst, 4 * sms))]
    for warps in (8, 16):
        for mode, name in ((0, "h-major"), (2, "h-major, mma stores"), (1, "pos-major")):
            rows.append((f"input {name}, {warps} warps/SM", pair_bytes + ab_bytes,
                         lambda m=mode, w=warps: module.input(pair, out_ab, 2 * hidden, m, sms, 32 * w)))
        for mode, name in ((0, "h-major"), (1, "pos-major")):
            rows.append((f"output {name}, {warps} warps/SM", z_bytes + 2 * pair_bytes,
                         lambda m=mode, w=warps: module.output(z, pair, out, hidden, m, sms, 32 * w)))
    raw_ab = module.raw_buffer(ab_bytes).view(torch.bfloat16)
    for mode, name in ((0, "h-major"), (2, "h-major, mma stores")):
        rows.append((f"input {name}, 8 warps/SM, cudaMalloc'd a/b", pair_bytes + ab_bytes,
                     lambda m=mode: module.input(pair, raw_ab, 2 * hidden, m, sms, 256)))
    print(f"{torch.cuda.get_device_name()}: positions {positions}, pair_dim {c}, hidden {hidden}")
    for name, moved, fn in rows:
        us = time_us(fn)
        print(f"{name:34s} {us:9.1f} us  {moved / us / 1e3:7.2f} TB/s  ({moved / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

// The ceiling of mma.sync on this GPU: how many TFLOP/s the m16n8k16 fp16 -> fp32 tensor-core
// instruction delivers with no memory traffic (mma), and with the shared-memory fragment loads
// (ldmatrix.x4) of a 64x64 warp tile per 16-deep k-step (mma+ldmatrix), for 4 or 8 warps per
// block and 1 or 2 blocks per SM. What an Ampere-style GEMM can reach on a Hopper GPU is
// bounded by these numbers (wgmma is a different, faster path).
//
//   nvcc -O3 -arch=sm_90a -o /tmp/mma_peak scripts/mma_peak.cu && /tmp/mma_peak
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

constexpr int MT = 4, NT = 8;  // a 64x64 warp tile: 4 x 8 mma tiles of 16x8

__device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <bool kLoad>
__global__ void peak(float* out, int iters) {
  __shared__ __align__(128) uint32_t smem[8192];  // 32 KB of fragments
  for (int i = threadIdx.x; i < 8192; i += blockDim.x) smem[i] = 0x3c003c00u ^ i;  // 1.0h pairs
  __syncthreads();
  float acc[MT][NT][4] = {};
  uint32_t a[MT][4], b[NT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[i][e] = 0x3c003c00u ^ (threadIdx.x + i + e);
#pragma unroll
  for (int j = 0; j < NT; ++j) b[j][0] = b[j][1] = 0x3c003c00u ^ (threadIdx.x + j);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Each lane reads one 16-byte row; the eight rows of a matrix sit in eight bank groups.
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) +
                        ((warp * 32 + lane) * 16) % 16384;
  for (int it = 0; it < iters; ++it) {
    if constexpr (kLoad) {
#pragma unroll
      for (int i = 0; i < MT; ++i) ldmatrix_x4(a[i], base + ((i * 512 + it * 64) & 16383));
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, base + (((j + 8) * 512 + it * 64) & 16383));
        b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
      }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j) mma(acc[i][j], a[i], b[j]);
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) s += acc[i][j][0] + acc[i][j][1] + acc[i][j][2] + acc[i][j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

int main() {
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  float* out;
  cudaMalloc(&out, sizeof(float) * sms * 4 * 256);
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  const int iters = 20000;
  printf("SMs %d, max SM clock %d MHz\n", sms, clock_khz / 1000);
  for (int load = 0; load < 2; ++load) {
    for (int warps : {4, 8}) {
      for (int per_sm : {1, 2}) {
        const int blocks = sms * per_sm, threads = warps * 32;
        auto kernel = load ? peak<true> : peak<false>;
        kernel<<<blocks, threads>>>(out, 100);  // warm-up
        float best = 1e30f;
        for (int rep = 0; rep < 5; ++rep) {
          cudaEventRecord(t0);
          kernel<<<blocks, threads>>>(out, iters);
          cudaEventRecord(t1);
          cudaEventSynchronize(t1);
          float ms;
          cudaEventElapsedTime(&ms, t0, t1);
          best = ms < best ? ms : best;
        }
        const double flops = 2.0 * 16 * 8 * 16 * MT * NT * (double)iters * warps * blocks;
        printf("%-14s warps/block %d blocks/SM %d: %7.1f TFLOP/s (%.3f ms)\n", load ? "mma+ldmatrix" : "mma",
               warps, per_sm, flops / (best * 1e-3) / 1e12, best);
      }
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}

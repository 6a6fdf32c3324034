// The ceiling of the sm80_mma template's instruction: mma.sync.m16n8k16 fp16 -> fp32
// issued from registers only (no memory traffic), many independent accumulators per
// warp, every SM busy. Prints the achieved TFLOP/s; compare a template's TFLOP/s with it.
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a benchmarks/mma_sync_peak.cu -o mma_peak && ./mma_peak
#include <cstdio>
#include <cuda_runtime.h>

constexpr int CHAINS = 8;  // independent accumulators per warp, hides mma latency
constexpr int ITERS = 4096;

__global__ void mma_loop(float* out, unsigned seed) {
  unsigned a[4] = {seed, seed ^ 1u, seed ^ 2u, seed ^ 3u}, b[2] = {seed ^ 4u, seed ^ 5u};
  float acc[CHAINS][4] = {};
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
          : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float s = 0.f;
  for (int c = 0; c < CHAINS; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  if (s == 12345.f) out[threadIdx.x] = s;  // keeps the loop alive
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  cudaMalloc(&out, 1024 * sizeof(float));
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int warps = 4; warps <= 16; warps *= 2) {
    const int blocks = sms * 2, threads = warps * 32 / 2;
    mma_loop<<<blocks, threads>>>(out, 7);
    cudaEventRecord(start);
    mma_loop<<<blocks, threads>>>(out, 7);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    const double flops = 2.0 * 16 * 8 * 16 * CHAINS * ITERS * (double)blocks * threads / 32;
    printf("mma.sync m16n8k16 f16->f32: %2d warps/SM: %.1f TFLOP/s\n", warps, flops / ms / 1e9);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

// What the memory system moves per second, by working-set size: 16-byte stores (write), 16-byte
// loads (read) and both (copy), each over a buffer written or read in full per launch, timed by
// CUDA events over many launches. Where the set fits in L2, the stores stay there as dirty lines
// and the numbers are L2's; past it, DRAM's. A GEMM whose C fits in L2 (a short K: 4096x4096
// fp16 is 32 MB) is bounded by the first, not by the DRAM floor.
//   nvcc -O3 -arch=sm_90a -o /tmp/l2_bandwidth benchmarks/l2_bandwidth.cu && /tmp/l2_bandwidth
#include <cstdio>
#include <cuda_runtime.h>

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e = (x);                                                         \
    if (e != cudaSuccess) {                                                      \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e));                        \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

__global__ void write16(uint4* __restrict__ out, size_t n, unsigned seed) {
  const uint4 v = make_uint4(seed, seed + 1, seed + 2, seed + 3);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    out[i] = v;
  }
}

__global__ void read16(const uint4* __restrict__ in, size_t n, unsigned* __restrict__ sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = in[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; never true for the data written
}

__global__ void copy16(const uint4* __restrict__ in, uint4* __restrict__ out, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    out[i] = in[i];
  }
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const size_t sizes_mb[] = {4, 8, 16, 24, 32, 40, 48, 64, 128, 1024};
  const size_t largest = 1024ull << 20;
  uint4 *a = nullptr, *b = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&a, largest));
  CHECK(cudaMalloc(&b, largest));
  CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  const int threads = 512, blocks = sms * 4;
  std::printf("%d SMs, L2 %d MB; GB/s over a buffer of each size (copy: bytes read + written)\n", sms, l2 >> 20);
  std::printf("%8s %10s %10s %10s\n", "MB", "write", "read", "copy");
  for (size_t mb : sizes_mb) {
    const size_t bytes = mb << 20, n = bytes / sizeof(uint4);
    const int reps = mb <= 64 ? 200 : mb <= 128 ? 20 : 4;
    float ms[3] = {};
    for (int kind = 0; kind < 3; ++kind) {
      for (int warm = 0; warm < 3; ++warm) {
        write16<<<blocks, threads>>>(a, n, 7u);
        if (kind == 2) copy16<<<blocks, threads>>>(a, b, n);
      }
      CHECK(cudaEventRecord(start));
      for (int r = 0; r < reps; ++r) {
        if (kind == 0) write16<<<blocks, threads>>>(a, n, (unsigned)r);
        if (kind == 1) read16<<<blocks, threads>>>(a, n, sink);
        if (kind == 2) copy16<<<blocks, threads>>>(a, b, n);
      }
      CHECK(cudaEventRecord(end));
      CHECK(cudaEventSynchronize(end));
      CHECK(cudaEventElapsedTime(&ms[kind], start, end));
      CHECK(cudaGetLastError());
    }
    const double gb = (double)bytes * reps / 1e9;
    std::printf("%8zu %10.0f %10.0f %10.0f\n", mb, gb / (ms[0] * 1e-3), gb / (ms[1] * 1e-3), 2 * gb / (ms[2] * 1e-3));
  }
  return 0;
}

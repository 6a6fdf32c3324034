// A free-form kernel for cudal2: C = A @ B, fp16, layout nn, fp32 accumulation.
// One thread per output element; slow, but it shows everything the ABI asks for:
// an extern "C" cudal2_gemm that launches on the given stream and returns 0, with no
// allocation, synchronisation or library call. It needs no workspace, so it does not
// define cudal2_workspace_bytes.
#include <cuda_runtime.h>
#include <cuda_fp16.h>

__global__ void simt_gemm(const __half* A, const __half* B, __half* C, int M, int N, int K) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  if (row >= M || col >= N) return;
  float acc = 0.f;
  for (int k = 0; k < K; ++k) acc += __half2float(A[(size_t)row * K + k]) * __half2float(B[(size_t)k * N + col]);
  C[(size_t)row * N + col] = __float2half(acc);
}

extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  (void)workspace;
  (void)workspace_bytes;
  dim3 block(16, 16), grid((N + 15) / 16, (M + 15) / 16);
  simt_gemm<<<grid, block, 0, stream>>>(static_cast<const __half*>(A), static_cast<const __half*>(B),
                                        static_cast<__half*>(C), M, N, K);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
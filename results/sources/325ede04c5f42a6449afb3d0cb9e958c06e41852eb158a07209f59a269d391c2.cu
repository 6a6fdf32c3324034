#define CUDAL2_TILE_M 256
#define CUDAL2_TILE_N 128
#define CUDAL2_TILE_K 32
#define CUDAL2_WARP_M 64
#define CUDAL2_WARP_N 64
#define CUDAL2_STAGES 3
// A free-form kernel built from CUTLASS 2.x's device-level GEMM for Ampere (mma.sync
// m16n8k16, cp.async multistage pipeline): the well-tuned reference an mma.sync kernel is
// measured against on newer GPUs, where tensor cores are faster through wgmma.
//
//   cudal2 bench --m 4096 --n 4096 --k 4096 --kernel examples/cutlass2_sm80_gemm_fp16_nn.cu
//
// fp16, layout nn, fp32 accumulation. Its 16-byte vector loads need K and N to be
// multiples of 8; other shapes are declined (non-zero return), as the ABI allows.
#include <cuda_runtime.h>

#include "cutlass/gemm/device/gemm.h"

namespace {

#ifndef CUDAL2_TILE_M  // the threadblock tile and its warp tile; 128x256x32 / 64x64x32 by default
#define CUDAL2_TILE_M 128
#define CUDAL2_TILE_N 256
#define CUDAL2_TILE_K 32
#define CUDAL2_WARP_M 64
#define CUDAL2_WARP_N 64
#define CUDAL2_STAGES 3
#endif

using Gemm = cutlass::gemm::device::Gemm<
    cutlass::half_t, cutlass::layout::RowMajor,   // A[M,K]
    cutlass::half_t, cutlass::layout::RowMajor,   // B[K,N]
    cutlass::half_t, cutlass::layout::RowMajor,   // C[M,N]
    float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<CUDAL2_TILE_M, CUDAL2_TILE_N, CUDAL2_TILE_K>,
    cutlass::gemm::GemmShape<CUDAL2_WARP_M, CUDAL2_WARP_N, CUDAL2_TILE_K>,
    cutlass::gemm::GemmShape<16, 8, 16>,
    cutlass::epilogue::thread::LinearCombination<cutlass::half_t, 8, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, CUDAL2_STAGES>;

}  // namespace

extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  (void)workspace_bytes;
  using T = cutlass::half_t;
  typename Gemm::Arguments args({M, N, K}, {static_cast<const T*>(A), K}, {static_cast<const T*>(B), N},
                                {static_cast<T*>(C), N}, {static_cast<T*>(C), N}, {1.0f, 0.0f});
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return 1;
  Gemm gemm;
  return gemm(args, workspace, stream) == cutlass::Status::kSuccess ? 0 : 2;
}

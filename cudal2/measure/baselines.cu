// The library baselines behind the kernel ABI, so that each is timed, captured in a graph and
// checked exactly like a candidate. Trusted code (the libraries a user would call), compiled
// once per dtype and layout. The including source defines CUDAL2_LT_TYPE (CUDA_R_16F or
// CUDA_R_16BF), CUDAL2_LT_NT (1: B is W[N,K] row-major, C = A @ W^T; 0: B is [K,N] row-major)
// and CUDAL2_CUBLAS_DEFAULT (1: cudal2_gemm is cublasGemmEx with the default algorithm, its
// workspace the ABI's, as torch sets one; 0: cuBLASLt with the selected algorithm).
//
// cudal2_lt_heuristics(M, N, K, requested) asks the heuristic for its top algorithms for that
// shape (with a workspace of CUDAL2_LT_WORKSPACE bytes); cudal2_lt_select(i) picks the one
// cudal2_gemm runs; cudal2_lt_describe(i, out) writes its configuration (algo id, tile, stages,
// split-K, reduction, swizzle, custom option) so that the autotuned choice can be recorded.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cstddef>

#ifndef CUDAL2_LT_WORKSPACE
#define CUDAL2_LT_WORKSPACE (32u << 20)
#endif

namespace {

constexpr int kMaxAlgos = 64;

struct Plan {
  int m = -1, n = -1, k = -1;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulHeuristicResult_t results[kMaxAlgos];
  int count = 0;
  int selected = 0;
};

cublasLtHandle_t handle = nullptr;
Plan plan;

void release() {
  if (plan.op) cublasLtMatmulDescDestroy(plan.op);
  if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
  if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
  if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
  plan = Plan();
}

// Row-major C[M,N] is column-major C^T[N,M] = B^T A^T: cuBLASLt's "A" is B (N x K after its op),
// its "B" is A (K x M, A's row-major storage read column-major).
int build(int M, int N, int K, int requested) {
  if (!handle && cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return -1;
  release();
  const cublasOperation_t op_b = CUDAL2_LT_NT ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = CUBLAS_OP_N;
  if (cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return -2;
  cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b));
  cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a));
  bool ok = CUDAL2_LT_NT
      ? cublasLtMatrixLayoutCreate(&plan.a, CUDAL2_LT_TYPE, K, N, K) == CUBLAS_STATUS_SUCCESS
      : cublasLtMatrixLayoutCreate(&plan.a, CUDAL2_LT_TYPE, N, K, N) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&plan.b, CUDAL2_LT_TYPE, K, M, K) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&plan.c, CUDAL2_LT_TYPE, N, M, N) == CUBLAS_STATUS_SUCCESS;
  if (!ok) return -3;
  cublasLtMatmulPreference_t pref;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return -4;
  size_t workspace = CUDAL2_LT_WORKSPACE;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  int returned = 0;
  if (requested > kMaxAlgos) requested = kMaxAlgos;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, plan.op, plan.a, plan.b, plan.c, plan.c, pref,
                                                         requested, plan.results, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS) return -5;
  int kept = 0;  // only algorithms the heuristic says will run
  for (int i = 0; i < returned; ++i)
    if (plan.results[i].state == CUBLAS_STATUS_SUCCESS) plan.results[kept++] = plan.results[i];
  plan.m = M, plan.n = N, plan.k = K, plan.count = kept, plan.selected = 0;
  return kept;
}

}  // namespace

extern "C" int cudal2_lt_heuristics(int M, int N, int K, int requested) { return build(M, N, K, requested); }

extern "C" int cudal2_lt_select(int index) {
  if (index < 0 || index >= plan.count) return 1;
  plan.selected = index;
  return 0;
}

extern "C" int cudal2_lt_describe(int index, int* out) {
  if (index < 0 || index >= plan.count) return 1;
  const cublasLtMatmulAlgo_t* algo = &plan.results[index].algo;
  const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
      CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
      CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
      CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
  for (int i = 0; i < 8; ++i) {
    unsigned value = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(algo, attrs[i], &value, sizeof(value), &written);
    out[i] = static_cast<int>(value);
  }
  return 0;
}

extern "C" size_t cudal2_workspace_bytes(int, int, int) { return CUDAL2_LT_WORKSPACE; }

#if CUDAL2_CUBLAS_DEFAULT
// Row-major C[M,N] = column-major C^T = B^T A^T, as above.
extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  static cublasHandle_t blas = nullptr;
  if (!blas && cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) return 1;
  if (cublasSetStream(blas, stream) != CUBLAS_STATUS_SUCCESS) return 2;
  if (cublasSetWorkspace(blas, workspace, workspace_bytes) != CUBLAS_STATUS_SUCCESS) return 3;
  const float alpha = 1.f, beta = 0.f;
  const cublasOperation_t op_b = CUDAL2_LT_NT ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int ldb = CUDAL2_LT_NT ? K : N;
  return cublasGemmEx(blas, op_b, CUBLAS_OP_N, N, M, K, &alpha, B, CUDAL2_LT_TYPE, ldb, A, CUDAL2_LT_TYPE, K,
                      &beta, C, CUDAL2_LT_TYPE, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS
             ? 0 : 4;
}
#else
extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  if (M != plan.m || N != plan.n || K != plan.k) {
    if (build(M, N, K, 1) <= 0) return 1;
  }
  const float alpha = 1.f, beta = 0.f;
  const cublasLtMatmulHeuristicResult_t& chosen = plan.results[plan.selected];
  if (chosen.workspaceSize > workspace_bytes) return 2;
  return cublasLtMatmul(handle, plan.op, &alpha, B, plan.a, A, plan.b, &beta, C, plan.c, C, plan.c, &chosen.algo,
                        workspace, workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS ? 0 : 3;
}
#endif

// cudal2 best kernel for C[128,4096] = A[128,64] @ B (fp16, layout nn, fp32 accumulation)
// speedup 0.889x over the fastest library call, cuBLASLt (2.76 us -> 3.11 us, offline, bench cupti-graph) on NVIDIA H200 (sm_90a)
// measured 2026-12-01 09:50:49.916209+00:00; template sm80_mma {"block_k": 64, "block_m": 32, "block_n": 64, "epilogue": "direct", "group_m": 8, "min_blocks": 1, "split_k": 1, "stages": 2, "warps_m": 1, "warps_n": 2}
// build (the flags cudal2 compiles with): nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC,-fno-gnu-unique -Xlinker -Bsymbolic -cudart shared --expt-relaxed-constexpr -Xptxas -v -gencode=arch=compute_90a,code=sm_90a -I/work/venv/lib/python3.11/site-packages/cutlass_library/source/include -I/work/venv/lib/python3.11/site-packages/cutlass_library/source/tools/util/include kernel.cu -o kernel.so
// cudal2 template sm80_mma: Ampere-style tensor-core GEMM (runs on sm_80 and newer).
// mma.sync.m16n8k16 with fp32 accumulation, ldmatrix fragment loads, a 2-stage
// cp.async shared-memory pipeline and XOR-swizzled shared memory. Edges are handled
// inside the kernel: out-of-range rows and columns are zero-filled on load and masked on
// store, and rows that are not 16-byte aligned (K or N not a multiple of 8) take a
// scalar-load path, so every M, N, K >= 1 is supported. With split_k > 1 (sm_90 and newer)
// a thread-block cluster of split_k CTAs shares one output tile: each multiplies a slice of
// K, and the partial tiles are summed through distributed shared memory in a fixed order,
// so small or skinny problems fill the GPU without a workspace or a second launch.
// Built for sm_90 or newer, it is launched with programmatic dependent launch: it may start
// while the kernel before it on the stream finishes, and waits (griddepcontrol.wait) for that
// kernel's writes before its first memory access; it lets the next kernel launch
// (griddepcontrol.launch_dependents) once its main loop is done.
//
// dtype=fp16 layout=nn block=32x64x64
// warps=1x2 stages=2 group_m=8 split_k=1 epilogue=direct
#include <cuda_runtime.h>

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace {


using Element = __half;
#define CUDAL2_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ Element to_element(float x) { return __float2half_rn(x); }


constexpr bool kTransB = false;  // B given as W[N,K]
constexpr int BM = 32, BN = 64, BK = 64;
constexpr int WARPS_M = 1, WARPS_N = 2;
constexpr int STAGES = 2, GROUP_M = 8, SPLIT_K = 1;
constexpr int THREADS = WARPS_M * WARPS_N * 32;
constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;  // warp tile
constexpr int MT = WTM / 16, NT = WTN / 8;              // mma tiles per warp
constexpr int KSTEPS = BK / 16;
static_assert(WTM % 16 == 0 && WTN % 16 == 0 && BK % 32 == 0, "tile shape");
static_assert(KSTEPS % 2 == 0, "fragment double buffering alternates per k-step");

// Shared-memory tiles are stored as rows of 16-byte chunks. A tile is BM x BK, B is
// BK x BN (nn) or BN x BK (nt). The chunk column is XOR-swizzled with the row so that the
// eight row addresses of one ldmatrix land in eight different 16-byte bank groups.
constexpr int A_ROWS = BM, A_CHUNKS = BK / 8;
constexpr int B_ROWS = kTransB ? BN : BK, B_CHUNKS = kTransB ? BK / 8 : BN / 8;
constexpr int A_STAGE = A_ROWS * A_CHUNKS * 8, B_STAGE = B_ROWS * B_CHUNKS * 8;  // elements
// Split-K: the fp32 partial tile of a CTA, rows padded by 4 floats against bank conflicts.
constexpr int RED_LD = BN + 4;
constexpr int PIPE_BYTES = STAGES * (A_STAGE + B_STAGE) * (int)sizeof(Element);
// The smem epilogue: the fp16/bf16 output tile, rows padded by 8 elements.
constexpr int OUT_LD = BN + 8;
constexpr int EPI_BYTES = 0;
constexpr int SMEM_BYTES = EPI_BYTES > PIPE_BYTES ? EPI_BYTES : PIPE_BYTES;
static_assert(BM % SPLIT_K == 0, "each CTA of a cluster reduces BM / SPLIT_K rows");

template <int L>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  if constexpr (L >= 8) {
    return row * L + (chunk ^ (row & 7));
  } else {
    return row * L + (chunk ^ ((row / (8 / L)) % L));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  // src-size 0 zero-fills the 16 bytes: out-of-range chunks become zeros. L2::128B lets the
  // L2 fetch the whole 128-byte line, which the neighbouring chunks of the row need next.
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(CUDAL2_MMA " { %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One ROWS x CHUNKS tile of 16-byte chunks of a row-major matrix with `ld` elements per
// row. Thread tid owns chunk column c = tid % CHUNKS of rows r = tid / CHUNKS, r + RPP, ...
// (PER of them), the same in every K tile.
template <int ROWS, int CHUNKS>
struct TileCopy {
  static_assert(THREADS % CHUNKS == 0, "a pass of the threads covers whole rows");
  static constexpr int RPP = THREADS / CHUNKS;  // rows per pass
  static constexpr int PER = (ROWS + RPP - 1) / RPP;
  static constexpr int TOTAL = ROWS * CHUNKS;

  // Aligned rows (16-byte row starts, column counts a multiple of 8): a chunk is entirely in
  // or out of range, and cp.async moves it straight to shared memory (zeros if out). The
  // cursor is one pointer and two remaining extents, advanced tile by tile, so a thread's
  // loads cost a handful of registers however many chunks it moves.
  struct Cursor {
    const Element* ptr;  // this thread's first chunk of the current tile
    int ld;
    int rows_left, cols_left;  // valid rows from, and valid columns from, that chunk

    __device__ __forceinline__ Cursor(const Element* g, int ld_, int row0, int rows, int col0, int cols,
                                      int tid)
        : ld(ld_) {
      const int r = tid / CHUNKS, c = tid % CHUNKS;
      rows_left = rows - row0 - r;
      cols_left = cols - col0 - c * 8;
      ptr = g + (long long)(row0 + r) * ld + col0 + c * 8;
    }
    __device__ __forceinline__ void next_cols(int n) { ptr += n; cols_left -= n; }
    __device__ __forceinline__ void next_rows(int n) { ptr += (long long)n * ld; rows_left -= n; }
  };

  static __device__ __forceinline__ void async(Element* smem, const Cursor& at, int tid) {
    const int r = tid / CHUNKS, c = tid % CHUNKS;
    // The swizzle repeats every 8 rows: with RPP a multiple of 8 the passes are a constant apart.
    const int first = swizzle<CHUNKS>(r, c) * 8;
    const Element* g = at.ptr;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (ROWS % RPP == 0 || r + i * RPP < ROWS) {
        const int at_smem = RPP % 8 == 0 ? first + i * RPP * CHUNKS * 8 : swizzle<CHUNKS>(r + i * RPP, c) * 8;
        // Out of range: src-size 0 reads nothing and zero-fills.
        cp_async16(smem + at_smem, g, i * RPP < at.rows_left && at.cols_left > 0);
      }
      g += (long long)RPP * at.ld;
    }
  }

  // Unaligned rows: chunks are gathered element by element (bounds-checked) into
  // registers; `put` writes them to shared memory later, so the loads' latency overlaps
  // the multiplies in between instead of stalling the warp.
  static __device__ __forceinline__ void fetch(uint4* regs, const Element* g, int ld, int row0,
                                               int rows, int col0, int cols, int tid) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int idx = tid + i * THREADS;
      if (TOTAL % THREADS == 0 || idx < TOTAL) {
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const int gr = row0 + r, gc = col0 + c * 8;
        alignas(16) Element v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          v[e] = (gr < rows && gc + e < cols) ? g[(size_t)gr * ld + gc + e] : to_element(0.f);
        }
        regs[i] = *reinterpret_cast<const uint4*>(v);
      }
    }
  }

  static __device__ __forceinline__ void put(Element* smem, const uint4* regs, int tid) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int idx = tid + i * THREADS;
      if (TOTAL % THREADS == 0 || idx < TOTAL) {
        *reinterpret_cast<uint4*>(smem + swizzle<CHUNKS>(idx / CHUNKS, idx % CHUNKS) * 8) = regs[i];
      }
    }
  }
};
using CopyA = TileCopy<A_ROWS, A_CHUNKS>;
using CopyB = TileCopy<B_ROWS, B_CHUNKS>;

template <bool kAligned>
__global__ void __launch_bounds__(THREADS, 1)
gemm_kernel(const Element* __restrict__ A, const Element* __restrict__ B,
            Element* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* sA = reinterpret_cast<Element*>(smem_raw);
  Element* sB = sA + STAGES * A_STAGE;

  // Grouped rasterisation: GROUP_M row-blocks walk the columns together for L2 reuse.
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int pid = blockIdx.x;
  const int per_group = GROUP_M * tiles_n;
  const int first_m = (pid / per_group) * GROUP_M;
  const int group_rows = min(tiles_m - first_m, GROUP_M);
  const int tile_m = first_m + (pid % per_group) % group_rows;
  const int tile_n = (pid % per_group) / group_rows;
  const int bm = tile_m * BM, bn = tile_n * BN;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  // This CTA's K tiles: all of them, or with split-K the slice of its rank (possibly none).
  int kt0 = 0, k_tiles = (K + BK - 1) / BK;
  if constexpr (SPLIT_K > 1) {
    const int per = (k_tiles + SPLIT_K - 1) / SPLIT_K;
    kt0 = blockIdx.z * per;
    k_tiles = max(0, min(k_tiles - kt0, per));
  }

  // Aligned rows: cp.async the next K tile into `stage` and advance the cursors. Unaligned:
  // gather K tile `kt` into registers (fetch) and write them to `stage` later (put). Tiles
  // are loaded in order, kt = 0, 1, 2, ... (Spreading the cp.async over the k-steps, as
  // CUTLASS 2 does, measured 3% slower with 64-deep K tiles on an H200: docs/.)
  typename CopyA::Cursor cur_a(A, K, bm, M, kt0 * BK, K, tid);
  typename CopyB::Cursor cur_b = kTransB ? typename CopyB::Cursor(B, K, bn, N, kt0 * BK, K, tid)
                                         : typename CopyB::Cursor(B, N, kt0 * BK, K, bn, N, tid);
  uint4 ra[kAligned ? 1 : CopyA::PER], rb[kAligned ? 1 : CopyB::PER];
  auto load_stage = [&](int stage, int kt) {
    if constexpr (kAligned) {
      CopyA::async(sA + stage * A_STAGE, cur_a, tid);
      CopyB::async(sB + stage * B_STAGE, cur_b, tid);
      cur_a.next_cols(BK);
      if constexpr (kTransB) {
        cur_b.next_cols(BK);
      } else {
        cur_b.next_rows(BK);
      }
    } else {
      const int k0 = (kt0 + kt) * BK;
      CopyA::fetch(ra, A, K, bm, M, k0, K, tid);
      if constexpr (kTransB) {
        CopyB::fetch(rb, B, K, bn, N, k0, K, tid);
      } else {
        CopyB::fetch(rb, B, N, k0, K, bn, N, tid);
      }
    }
  };
  auto put_stage = [&](int stage) {
    if constexpr (!kAligned) {
      CopyA::put(sA + stage * A_STAGE, ra, tid);
      CopyB::put(sB + stage * B_STAGE, rb, tid);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) {
      load_stage(s, s);
      put_stage(s);
    }
    cp_async_commit();
  }

  uint32_t fa[2][MT][4], fb[2][NT][2];
  // Byte offsets of this lane's first fragment rows within a stage. A row's swizzle depends
  // only on row & 7, which the lane fixes, and tile sizes are powers of two, so the other
  // mma tiles and k-steps are a constant added to these and a constant XORed into the
  // chunk bits: no per-fragment address registers.
  const uint32_t a_lane = swizzle<A_CHUNKS>(wm * WTM + (lane & 15), lane >> 4) * 16;
  const uint32_t b_lane = kTransB
      ? swizzle<B_CHUNKS>(wn * WTN + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1) * 16
      : swizzle<B_CHUNKS>((lane & 7) + (((lane >> 3) & 1) << 3), wn * WTN / 8 + (lane >> 4)) * 16;
  const uint32_t sA_addr = smem_addr(sA), sB_addr = smem_addr(sB);
  // Fragment loads for k-step `ks` of shared stage `stage` into register buffer `buf`.
  auto load_fragments = [&](int buf, int stage, int ks) {
    const uint32_t a = sA_addr + stage * A_STAGE * 2, b = sB_addr + stage * B_STAGE * 2;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      ldmatrix_x4(fa[buf][i], a + ((a_lane + i * 16 * A_CHUNKS * 16) ^ (ks * 32)));
    }
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      uint32_t r[4];
      if constexpr (kTransB) {
        // W tile is n-major: matrices (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7) (n8-15,k8-15).
        ldmatrix_x4(r, b + ((b_lane + j * 8 * B_CHUNKS * 16) ^ (ks * 32)));
      } else {
        // B tile is k-major: transposed loads of (k0-7,n0-7) (k8-15,n0-7) (k0-7,n8-15) (k8-15,n8-15).
        ldmatrix_x4_trans(r, b + ((b_lane + ks * 16 * B_CHUNKS * 16) ^ (j * 16)));
      }
      fb[buf][j][0] = r[0];
      fb[buf][j][1] = r[1];
      fb[buf][j + 1][0] = r[2];
      fb[buf][j + 1][1] = r[3];
    }
  };

  // Main loop. Fragments for the next k-step are loaded while this one multiplies; at the
  // last k-step of a tile the barrier comes first, so the next tile's first fragments are
  // loaded before the last multiplies of this one and the barrier's wait overlaps them.
  cp_async_wait<STAGES - 2>();
  __syncthreads();
  load_fragments(0, 0, 0);
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int stage = kt % STAGES, next = kt + STAGES - 1;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      if (ks == KSTEPS - 1) {
        if (next < k_tiles) put_stage(next % STAGES);  // fetched at ks == 0
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt+1 has landed, and no warp reads stage kt any more
      }
      load_fragments((ks + 1) & 1, ks == KSTEPS - 1 ? (kt + 1) % STAGES : stage, (ks + 1) % KSTEPS);
      if (ks == 0) {  // refill the stage every warp finished with before the last barrier
        if (next < k_tiles) load_stage(next % STAGES, next);
        cp_async_commit();
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) mma(acc[i][j], fa[ks & 1][i], fb[ks & 1][j]);
    }
  }
  cp_async_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif

  const int g = lane >> 2, t = lane & 3;

  // Epilogue: each thread holds pairs of adjacent columns; pairs are stored as one 32-bit
  // word when the row is 4-byte aligned (N even), else element by element.
  const bool paired = (N & 1) == 0 && (reinterpret_cast<uintptr_t>(C) & 3) == 0;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = bn + wn * WTN + j * 8 + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = bm + wm * WTM + i * 16 + g + 8 * h;
        if (row >= M) continue;
        Element* out = C + (size_t)row * N + col;
        const float lo = acc[i][j][2 * h], hi = acc[i][j][2 * h + 1];
        if (paired && col + 1 < N) {
          *reinterpret_cast<uint32_t*>(out) = pack2(lo, hi);
        } else {
          if (col < N) out[0] = to_element(lo);
          if (col + 1 < N) out[1] = to_element(hi);
        }
      }
    }
  }

}

// Whether gemm_kernel was built for sm_90 or newer, and so waits for the kernel before it
// (griddepcontrol.wait): only then may it be launched with programmatic dependent launch.
template <bool kAligned>
bool waits_for_predecessor() {
  static const bool built_for_90 = [] {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, gemm_kernel<kAligned>) == cudaSuccess && attr.binaryVersion >= 90;
  }();
  return built_for_90;
}

template <bool kAligned>
int launch(const Element* A, const Element* B, Element* C, int M, int N, int K,
           cudaStream_t stream) {
  constexpr int smem = SMEM_BYTES;
  // Per function and device; cheap, and capture-safe, so set on every call.
  if (cudaFuncSetAttribute(gemm_kernel<kAligned>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem) != cudaSuccess) {
    return 2;
  }
  const long long tiles = (long long)((M + BM - 1) / BM) * ((N + BN - 1) / BN);
  if (tiles > 0x7fffffffLL) return 3;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)tiles, 1, SPLIT_K);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = waits_for_predecessor<kAligned>() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, gemm_kernel<kAligned>, A, B, C, M, N, K) == cudaSuccess ? 0 : 4;
}

}  // namespace

extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  (void)workspace;
  (void)workspace_bytes;
  if (M <= 0 || N <= 0 || K <= 0) return 1;
  const bool aligned16 = ((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B)) & 15) == 0;
  const bool rows16 = K % 8 == 0 && (kTransB || N % 8 == 0);
  const Element* a = static_cast<const Element*>(A);
  const Element* b = static_cast<const Element*>(B);
  Element* c = static_cast<Element*>(C);
  return (aligned16 && rows16) ? launch<true>(a, b, c, M, N, K, stream)
                               : launch<false>(a, b, c, M, N, K, stream);
}

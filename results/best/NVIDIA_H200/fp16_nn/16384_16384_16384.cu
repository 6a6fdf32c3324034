// cudal2 best kernel for C[16384,16384] = A[16384,16384] @ B (fp16, layout nn, fp32 accumulation)
// speedup 0.977x over the fastest library call, cuBLAS (11542.38 us -> 11814.03 us, offline, bench cupti-graph) on NVIDIA H200 (sm_90a)
// measured 2026-12-01 09:53:01.839736+00:00; template sm90_cutlass {"cluster_m": 1, "cluster_n": 2, "decomposition": "heuristic", "epilogue_schedule": "tma", "grid": "even", "kernel_schedule": "cooperative", "max_swizzle_size": 1, "raster_order": "along_m", "reduction": "deterministic", "splits": 1, "stages": "auto", "swap_ab": "no", "tile_k": 64, "tile_m": 256, "tile_n": 192, "tile_scheduler": "persistent"}
// build (the flags cudal2 compiles with): nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC,-fno-gnu-unique -Xlinker -Bsymbolic -cudart shared --expt-relaxed-constexpr -Xptxas -v -gencode=arch=compute_90a,code=sm_90a -I/work/venv/lib/python3.11/site-packages/cutlass_library/source/include -I/work/venv/lib/python3.11/site-packages/cutlass_library/source/tools/util/include kernel.cu -o kernel.so
// cudal2 / sm90_cutlass -- generated source, do not edit.
//   dtype=fp16 layout=nn
//   tile=256x192x64 cluster=1x2x1
//   kernel_schedule=cooperative epilogue_schedule=tma stages=auto
//   tile_scheduler=persistent raster_order=along_m max_swizzle_size=1
//   splits=1 reduction=deterministic grid=even
//
// C[M,N] = A[M,K] @ B[K,N]; fp32 accumulation, D = 1 * acc (no source C).
// M, N and K are run-time values. TMA needs rows of whole 16-byte units; where a row length
// (K, or N) is not a multiple of 8 elements, that operand is copied into the workspace with
// its rows padded, and the GEMM reads (or writes) the copy (see "Unaligned rows" below).

// Device code is built without assert(): a call to __assertfail inside the consumer warpgroups
// makes ptxas serialize the wgmma pipeline (warning C7510) and costs a lot of throughput. Only
// function bodies depend on NDEBUG in CUTLASS/CuTe, so host and device passes stay consistent;
// host-side asserts are kept.
#if defined(__CUDA_ARCH__) && !defined(NDEBUG)
#define NDEBUG
#endif

// Programmatic dependent launch: the GEMM is launched while the kernel before it on the stream
// may still run; it signals
// (griddepcontrol.launch_dependents) that the next kernel may be launched once its last tiles
// are under way, and waits (griddepcontrol.wait) for the one before to finish, its writes
// visible, before it reads or writes global memory. Set-up overlaps; memory accesses never do.
// (Not with stream-K: its tile counters are zeroed by a memset just before the launch.)
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"

// The warp-specialized TMA/GMMA kernels only have a body when compiled for the arch-specific
// target (sm_90a defines __CUDA_ARCH_FEAT_SM90_ALL); for plain sm_90 CUTLASS would silently
// produce a kernel that traps. Refuse to build that.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90_cutlass must be compiled for sm_90a (-gencode=arch=compute_90a,code=sm_90a)"
#endif
#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
#error "sm90_cutlass needs CUDA >= 12.0 (CUTLASS_ARCH_MMA_SM90_SUPPORTED)"
#endif

namespace cudal2_sm90 {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// Element types and layouts
// ---------------------------------------------------------------------------------------------
using Element = cutlass::half_t;
using ElementA = Element;
using ElementB = Element;
using ElementC = void;        // no source operand: D = alpha * acc
using ElementD = Element;
using ElementAccumulator = float;
using ElementCompute = float;

// A is M x K row-major (K-major).
using LayoutA = cutlass::layout::RowMajor;
// B is K x N row-major: CUTLASS's B operand (K x N) is row-major, i.e. N-major.
using LayoutB = cutlass::layout::RowMajor;
// C/D is M x N row-major.
using LayoutC = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;

// 16-byte vectors (TMA needs 16-byte aligned rows): 8 elements of 16 bits.
constexpr int AlignmentA = 128 / cutlass::sizeof_bits<ElementA>::value;
constexpr int AlignmentB = 128 / cutlass::sizeof_bits<ElementB>::value;
constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
constexpr int AlignmentC = AlignmentD;  // C is void; value only has to be well-formed

// ---------------------------------------------------------------------------------------------
// Tiling and schedules
// ---------------------------------------------------------------------------------------------
using TileShape    = Shape<Int<256>, Int<192>, Int<64>>;
using ClusterShape = Shape<Int<1>, Int<2>, _1>;

using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
// Whether the mainloop ends up cooperative (two consumer warpgroups sharing one tile). For
// "auto", CUTLASS picks cooperative unless tile_m == 64 (then ping-pong); checked below.
constexpr bool kCooperative = true;

// TMA warp-specialized epilogue, matched to the mainloop schedule.
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;

using TileSchedulerTag = cutlass::gemm::PersistentScheduler;

// ---------------------------------------------------------------------------------------------
// Collectives and kernel
// ---------------------------------------------------------------------------------------------
using FusionOp = cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC, ElementCompute>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto,
    ElementAccumulator, ElementCompute,
    ElementC, LayoutC, AlignmentC,
    ElementD, LayoutD, AlignmentD,
    EpilogueSchedule,
    FusionOp
  >::CollectiveOp;

// As many stages as fit next to the epilogue's shared memory.
using StageCountType = cutlass::gemm::collective::StageCountAutoCarveout<
    static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, LayoutA, AlignmentA,
    ElementB, LayoutB, AlignmentB,
    ElementAccumulator,
    TileShape, ClusterShape,
    StageCountType,
    KernelSchedule
  >::CollectiveOp;

using ProblemShape = Shape<int, int, int, int>;  // M, N, K, L (L = 1)

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    ProblemShape, CollectiveMainloop, CollectiveEpilogue, TileSchedulerTag>;

using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using ResolvedSchedule = typename CollectiveMainloop::DispatchPolicy::Schedule;
static_assert(std::is_same_v<ResolvedSchedule, cutlass::gemm::KernelTmaWarpSpecializedCooperative> == kCooperative,
              "template assumption about the resolved mainloop schedule is wrong");
static_assert(CollectiveMainloop::DispatchPolicy::Stages >= 2, "need at least two pipeline stages");

using StrideA = typename GemmKernel::StrideA;
using StrideB = typename GemmKernel::StrideB;
using StrideC = typename GemmKernel::StrideC;
using StrideD = typename GemmKernel::StrideD;
using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;

constexpr int kClusterM = 1;
constexpr int kClusterN = 2;
constexpr int kSmemBytes = GemmKernel::SharedStorageSize;

// ---- host side -------------------------------------------------------------------------------

// Per-device facts that do not depend on the problem: SM count, the number of co-resident
// clusters of this kernel, and whether the kernel can run there at all.
struct DeviceFacts {
  int sm_count = 0;
  int max_active_clusters = 0;
  bool usable = false;
};

constexpr int kMaxCachedDevices = 64;

struct DeviceSlot {
  std::atomic<int> state;  // 0 = unknown, 1 = filled
  DeviceFacts facts;
};

// Internal linkage: every loaded kernel library keeps its own cache (an `inline` variable
// would be one symbol shared by all libraries in the process).
static DeviceSlot g_device_slots[kMaxCachedDevices];

inline DeviceFacts query_device_facts(int device) {
  DeviceFacts f;
  int major = 0, minor = 0, sms = 0, smem_optin = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return f;
  }
  // sm_90a code runs on compute capability 9.0 only.
  if (major != 9 || minor != 0 || sms <= 0 || smem_optin < kSmemBytes) {
    return f;
  }
  // The kernel's dynamic shared memory exceeds the 48 KiB default: opt in (once per device).
  if (kSmemBytes >= (48 << 10)) {
    if (cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return f;
    }
  }
  f.sm_count = sms;
  // How many clusters fit at once; the persistent / stream-K schedulers size their grid with it.
  // 0 (unknown) makes CUTLASS fall back to its GH100 occupancy heuristic.
  if (kClusterM * kClusterN > 1) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kClusterM;
    attr[0].val.clusterDim.y = kClusterN;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kClusterM, kClusterN, 1);
    cfg.blockDim = dim3(GemmKernel::MaxThreadsPerBlock, 1, 1);
    cfg.dynamicSmemBytes = static_cast<size_t>(kSmemBytes);
    cfg.stream = nullptr;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, (void const*)cutlass::device_kernel<GemmKernel>, &cfg)
        != cudaSuccess) {
      (void)cudaGetLastError();
      clusters = 0;
    }
    f.max_active_clusters = clusters > 0 ? clusters : 0;
  }
  f.usable = true;
  return f;
}

// Facts for the current device (cached; the first call per device does the queries).
inline bool current_device_facts(int& device, DeviceFacts& facts) {
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (device < 0 || device >= kMaxCachedDevices) {
    facts = query_device_facts(device);
    return facts.usable;
  }
  DeviceSlot& slot = g_device_slots[device];
  if (slot.state.load(std::memory_order_acquire) != 1) {
    // A race between two first callers only repeats idempotent queries.
    slot.facts = query_device_facts(device);
    slot.state.store(1, std::memory_order_release);
  }
  facts = slot.facts;
  return facts.usable;
}

// ---- unaligned rows ----------------------------------------------------------------------------
// TMA walks rows whose length in bytes is a multiple of 16 (8 elements) from 16-byte aligned
// bases. A row-major operand whose row length is not (A when K % 8, B when N % 8,
// D when N % 8) goes through a copy in the workspace whose rows are padded to a multiple of
// 8 elements. The GEMM still sees the true M, N, K: TMA bounds its boxes by those extents,
// so the padding is never read (loads past K are zero-filled) and never written.
constexpr int kRowAlign = 128 / cutlass::sizeof_bits<Element>::value;

inline int64_t round_up(int64_t v, int64_t to) {
  return (v + to - 1) / to * to;
}

// Row lengths (leading dimensions, in elements) of A, B and D as the caller lays them out.
inline int64_t natural_lda(int M, int N, int K) { return K; }
inline int64_t natural_ldb(int M, int N, int K) { return N; }
inline int64_t natural_ldd(int M, int N, int K) { return N; }
// Rows of B as stored: K rows of N (B[K,N]).
inline int64_t rows_b(int M, int N, int K) { return K; }

// Where each operand lives for the GEMM, and the workspace carved out for it.
struct Plan {
  int64_t lda = 0, ldb = 0, ldd = 0;   // leading dimensions the GEMM uses
  bool copy_a = false, copy_b = false, copy_d = false;
  size_t gemm_bytes = 0;              // the kernel's own workspace (stream-K partials, flags)
  size_t off_a = 0, off_b = 0, off_d = 0, off_p = 0, total = 0;
  typename Gemm::Arguments args{};     // the GEMM's arguments, all but the operand pointers
};

constexpr size_t kWorkspaceAlign = 256;

inline size_t align_bytes(size_t v) {
  return (v + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Copies a rows x cols block of 16-bit elements between leading dimensions, where one side's
// rows may start at any 2-byte boundary. Each thread writes whole 16-byte chunks of the
// destination row: it loads the one or two aligned 16-byte chunks of the source that hold
// those 8 elements and shifts them into place (the shift is the same for a whole row, so it
// is a template argument picked per row). An aligned 16-byte chunk that holds a valid
// element never crosses a page, so reading its other bytes is safe; they are discarded.
// The unaligned head and tail of a destination row are copied element by element.
constexpr int kCopyThreads = 128;
constexpr int kChunk = 8;  // elements per 16-byte chunk

// Elements O .. O+7 of the 16 held in lo:hi (little-endian 16-bit lanes of 32-bit words).
template <int O>
__device__ __forceinline__ uint4 shifted(uint4 const& lo, uint4 const& hi) {
  uint32_t const w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  constexpr int q = O / 2;
  if constexpr (O % 2 == 0) {
    return make_uint4(w[q], w[q + 1], w[q + 2], w[q + 3]);
  } else {
    return make_uint4(__funnelshift_r(w[q], w[q + 1], 16), __funnelshift_r(w[q + 1], w[q + 2], 16),
                      __funnelshift_r(w[q + 2], w[q + 3], 16), __funnelshift_r(w[q + 3], w[q + 4], 16));
  }
}

// The aligned body of one row: destination chunks t = first, first + step, ... < chunks, each
// from source elements (src_at .. src_at + 7) where src_at = O (mod 8) is the chunk's start.
template <int O>
__device__ __forceinline__ void copy_chunks(uint16_t const* s, uint4* d, int64_t chunks, int64_t first, int64_t step) {
  uint4 const* base = reinterpret_cast<uint4 const*>(s - O);  // 16-byte aligned
  for (int64_t t = first; t < chunks; t += step) {
    uint4 const lo = __ldg(base + t);
    if constexpr (O == 0) {
      d[t] = lo;
    } else {
      d[t] = shifted<O>(lo, __ldg(base + t + 1));
    }
  }
}

__global__ void __launch_bounds__(kCopyThreads)
copy_rows(uint16_t const* __restrict__ src, int64_t src_ld, uint16_t* __restrict__ dst, int64_t dst_ld,
          int rows, int cols) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    uint16_t const* s = src + r * src_ld;
    uint16_t* d = dst + r * dst_ld;
    // Elements before the destination row reaches a 16-byte boundary, then whole chunks.
    int64_t const head_full = ((16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15) / 2;
    int64_t const head = head_full < cols ? head_full : cols;
    int64_t const chunks = (cols - head) / kChunk;
    int64_t const body_end = head + chunks * kChunk;
    if (blockIdx.x == 0) {
      for (int64_t c = threadIdx.x; c < head; c += kCopyThreads) d[c] = s[c];
      for (int64_t c = body_end + threadIdx.x; c < cols; c += kCopyThreads) d[c] = s[c];
    }
    uint16_t const* sb = s + head;
    uint4* db = reinterpret_cast<uint4*>(d + head);
    int64_t const first = int64_t(blockIdx.x) * kCopyThreads + threadIdx.x;
    int64_t const step = int64_t(gridDim.x) * kCopyThreads;
    switch ((reinterpret_cast<uintptr_t>(sb) & 15) / 2) {
      case 0: copy_chunks<0>(sb, db, chunks, first, step); break;
      case 1: copy_chunks<1>(sb, db, chunks, first, step); break;
      case 2: copy_chunks<2>(sb, db, chunks, first, step); break;
      case 3: copy_chunks<3>(sb, db, chunks, first, step); break;
      case 4: copy_chunks<4>(sb, db, chunks, first, step); break;
      case 5: copy_chunks<5>(sb, db, chunks, first, step); break;
      case 6: copy_chunks<6>(sb, db, chunks, first, step); break;
      default: copy_chunks<7>(sb, db, chunks, first, step); break;
    }
  }
}

inline cudaError_t launch_copy(void const* src, int64_t src_ld, void* dst, int64_t dst_ld, int rows, int cols,
                               cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) {
    return cudaSuccess;
  }
  int64_t const chunks = (int64_t(cols) + kChunk - 1) / kChunk;
  dim3 grid(static_cast<unsigned>((chunks + kCopyThreads - 1) / kCopyThreads),
            static_cast<unsigned>(rows < 65535 ? rows : 65535));
  copy_rows<<<grid, kCopyThreads, 0, stream>>>(static_cast<uint16_t const*>(src), src_ld,
                                                static_cast<uint16_t*>(dst), dst_ld, rows, cols);
  return cudaGetLastError();
}

// Kernel arguments for one shape, without the operand pointers (cudal2_gemm sets them).
// Everything that decides the workspace size (shape, scheduler options, hardware info) is set
// here, so cudal2_workspace_bytes and cudal2_gemm agree. lda / ldb / ldd are the leading
// dimensions of A, B and D in elements (see Plan).
inline typename Gemm::Arguments make_arguments(int M, int N, int K, int64_t lda, int64_t ldb, int64_t ldd,
                                               int device, DeviceFacts const& facts) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = ProblemShape{M, N, K, 1};

  // A packed stride over a shape whose contiguous extent is the leading dimension gives
  // that leading dimension.
  args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, int(lda), 1));
  args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(int(ldb), K, 1));

  args.epilogue.thread.alpha = ElementCompute(1);
  args.epilogue.thread.beta = ElementCompute(0);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(M, int(ldd), 1));
  args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(M, int(ldd), 1));

  args.hw_info.device_id = device;
  args.hw_info.sm_count = facts.sm_count;
  args.hw_info.max_active_clusters = facts.max_active_clusters;
  // An even grid: no more CTAs than it takes to give each as many tiles as the busiest CTA of
  // a full grid gets (512 tiles on 132 SMs: 128 CTAs of 4 tiles, not 116 of 4 and 16 of 3).
  // The tiles are counted as the scheduler counts them (rounded up to whole swizzle groups
  // and clusters).
  {
    using SchedulerParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
    int const gemm_m = cute::get<0>(args.problem_shape), gemm_n = cute::get<1>(args.problem_shape);
    int const tiles_m = (gemm_m + int(cute::size<0>(TileShape{})) - 1) / int(cute::size<0>(TileShape{}));
    int const tiles_n = (gemm_n + int(cute::size<1>(TileShape{})) - 1) / int(cute::size<1>(TileShape{}));
    int const swizzle = 1 << SchedulerParams::get_log_swizzle_size(tiles_m, tiles_n, 1);
    int64_t const total = int64_t(round_up(tiles_m, swizzle * kClusterM)) * round_up(tiles_n, swizzle * kClusterN) *
                          int64_t(cute::get<3>(args.problem_shape));
    int const cluster = kClusterM * kClusterN;
    int const slots = facts.max_active_clusters > 0 ? facts.max_active_clusters * cluster
                                                    : facts.sm_count / cluster * cluster;
    int64_t const waves = (total + slots - 1) / slots;
    int const ctas = int(round_up((total + waves - 1) / waves, int64_t(cluster)));
    args.hw_info.sm_count = std::min(facts.sm_count, ctas);
    if (facts.max_active_clusters > 0) {
      args.hw_info.max_active_clusters = std::min(facts.max_active_clusters, ctas / cluster);
    }
  }

  args.scheduler.max_swizzle_size = 1;
  args.scheduler.raster_order = RasterOrderOptions::AlongM;
  return args;
}

inline bool shape_ok(int M, int N, int K) {
  return M > 0 && N > 0 && K > 0;
}

inline bool aligned16(void const* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

// The GEMM's leading dimensions and the workspace layout for one shape: [kernel workspace]
// [A copy] [B copy] [D copy], each present only when that operand's rows are unaligned.
inline Plan make_plan(int M, int N, int K, int device, DeviceFacts const& facts) {
  Plan plan;
  plan.copy_a = natural_lda(M, N, K) % kRowAlign != 0;
  plan.copy_b = natural_ldb(M, N, K) % kRowAlign != 0;
  plan.copy_d = natural_ldd(M, N, K) % kRowAlign != 0;
  plan.lda = round_up(natural_lda(M, N, K), kRowAlign);
  plan.ldb = round_up(natural_ldb(M, N, K), kRowAlign);
  plan.ldd = round_up(natural_ldd(M, N, K), kRowAlign);
  plan.args = make_arguments(M, N, K, plan.lda, plan.ldb, plan.ldd, device, facts);
  plan.gemm_bytes = Gemm::get_workspace_size(plan.args);
  size_t const elem = sizeof(Element);
  size_t at = align_bytes(plan.gemm_bytes);
  if (plan.copy_a) { plan.off_a = at; at += align_bytes(size_t(M) * plan.lda * elem); }
  if (plan.copy_b) { plan.off_b = at; at += align_bytes(size_t(rows_b(M, N, K)) * plan.ldb * elem); }
  if (plan.copy_d) { plan.off_d = at; at += align_bytes(size_t(M) * plan.ldd * elem); }
  plan.total = (plan.copy_a || plan.copy_b || plan.copy_d) ? at : plan.gemm_bytes;
  return plan;
}

}  // namespace cudal2_sm90

// ---- ABI -------------------------------------------------------------------------------------

extern "C" size_t cudal2_workspace_bytes(int M, int N, int K) {
  using namespace cudal2_sm90;
  if (!shape_ok(M, N, K)) {
    return 0;
  }
  int device = 0;
  DeviceFacts facts;
  if (!current_device_facts(device, facts)) {
    return 0;
  }
  return make_plan(M, N, K, device, facts).total;
}

extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using namespace cudal2_sm90;
  if (!shape_ok(M, N, K)) {
    return 1;
  }
  // TMA descriptors need 16-byte aligned base addresses (CUTLASS asserts rather than failing).
  if (A == nullptr || B == nullptr || C == nullptr || !aligned16(A) || !aligned16(B) || !aligned16(C)) {
    return 2;
  }
  int device = 0;
  DeviceFacts facts;
  if (!current_device_facts(device, facts)) {
    return 3;
  }
  Plan const plan = make_plan(M, N, K, device, facts);
  if (plan.total > 0 && (workspace == nullptr || workspace_bytes < plan.total || !aligned16(workspace))) {
    return 5;
  }
  char* ws = static_cast<char*>(workspace);
  void const* a = plan.copy_a ? static_cast<void const*>(ws + plan.off_a) : A;
  void const* b = plan.copy_b ? static_cast<void const*>(ws + plan.off_b) : B;
  void* d = plan.copy_d ? static_cast<void*>(ws + plan.off_d) : C;
  auto args = plan.args;
  args.mainloop.ptr_A = static_cast<ElementA const*>(a);
  args.mainloop.ptr_B = static_cast<ElementB const*>(b);
  args.epilogue.ptr_D = static_cast<ElementD*>(d);
  // CUTLASS checks row alignment on the problem shape, not the strides: ask it about the
  // shape with padded rows, which is what the TMA descriptors see (the other checks, on
  // the cluster and scheduler, do not depend on it).
  auto padded = args;
  padded.problem_shape = ProblemShape{M, int(round_up(N, kRowAlign)), int(round_up(get<2>(args.problem_shape), kRowAlign)),
                                      get<3>(args.problem_shape)};
  if (Gemm::can_implement(padded) != cutlass::Status::kSuccess) {
    return 4;
  }
  if (plan.copy_a && launch_copy(A, natural_lda(M, N, K), ws + plan.off_a, plan.lda, M, K, stream) != cudaSuccess) {
    return 8;
  }
  if (plan.copy_b &&
      launch_copy(B, natural_ldb(M, N, K), ws + plan.off_b, plan.ldb, int(rows_b(M, N, K)),
                  int(natural_ldb(M, N, K)), stream) != cudaSuccess) {
    return 8;
  }
  void* gemm_ws = plan.gemm_bytes > 0 ? workspace : nullptr;
  // Stream-K: zeroes its tile counters / partial-sum flags with cudaMemsetAsync on `stream`.
  if (GemmKernel::initialize_workspace(args, gemm_ws, stream, nullptr) != cutlass::Status::kSuccess) {
    return 6;
  }
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, gemm_ws);
  // Programmatic dependent launch: the GEMM's set-up overlaps the tail of the kernel before it
  // on the stream; its producer waits (griddepcontrol.wait) before the first load, and every
  // write follows from those loads.
  if (Gemm::run(params, stream, nullptr, /*launch_with_pdl=*/true) != cutlass::Status::kSuccess) {
    return 7;
  }
  if (plan.copy_d && launch_copy(ws + plan.off_d, plan.ldd, C, natural_ldd(M, N, K), M, N, stream) != cudaSuccess) {
    return 8;
  }
  return 0;
}

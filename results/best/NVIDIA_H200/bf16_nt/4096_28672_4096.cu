// cudal2 best kernel for C[4096,28672] = A[4096,4096] @ W^T (bf16, layout nt, fp32 accumulation)
// speedup 0.982x over cuBLAS (1180.90 us -> 1202.37 us, offline device time) on NVIDIA H200 (sm_90a)
// measured 2026-11-30 08:42:27.796751+00:00; template sm90_cutlass {"cluster_m": 2, "cluster_n": 1, "epilogue_schedule": "tma", "kernel_schedule": "cooperative", "max_swizzle_size": 8, "raster_order": "along_n", "stages": "auto", "tile_k": 64, "tile_m": 128, "tile_n": 256, "tile_scheduler": "persistent"}
// build: nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a -I<cutlass>/include -I<cutlass>/tools/util/include kernel.cu -o kernel.so
// cudal2 / sm90_cutlass -- generated source, do not edit.
//   dtype=bf16 layout=nt
//   tile=128x256x64 cluster=2x1x1
//   kernel_schedule=cooperative epilogue_schedule=tma stages=auto
//   tile_scheduler=persistent raster_order=along_n max_swizzle_size=8
//
// C[M,N] = A[M,K] @ W[N,K]^T; fp32 accumulation, D = 1 * acc (no source C).
// M, N and K are run-time values.

// Device code is built without assert(): a call to __assertfail inside the consumer warpgroups
// makes ptxas serialize the wgmma pipeline (warning C7510) and costs a lot of throughput. Only
// function bodies depend on NDEBUG in CUTLASS/CuTe, so host and device passes stay consistent;
// host-side asserts are kept.
#if defined(__CUDA_ARCH__) && !defined(NDEBUG)
#define NDEBUG
#endif

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
using Element = cutlass::bfloat16_t;
using ElementA = Element;
using ElementB = Element;
using ElementC = void;        // no source operand: D = alpha * acc
using ElementD = Element;
using ElementAccumulator = float;
using ElementCompute = float;

// A is M x K row-major (K-major).
using LayoutA = cutlass::layout::RowMajor;
// B is given as W (N x K row-major); CUTLASS's B operand (K x N) is then column-major, i.e. K-major.
using LayoutB = cutlass::layout::ColumnMajor;
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
using TileShape    = Shape<Int<128>, Int<256>, Int<64>>;
using ClusterShape = Shape<Int<2>, Int<1>, _1>;

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

constexpr int kClusterM = 2;
constexpr int kClusterN = 1;
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

// Kernel arguments for one call. Everything that decides the workspace size (shape, scheduler
// options, hardware info) is set here, so cudal2_workspace_bytes and cudal2_gemm agree.
inline typename Gemm::Arguments make_arguments(
    void const* A, void const* B, void* D, int M, int N, int K, int device, DeviceFacts const& facts) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = ProblemShape{M, N, K, 1};

  args.mainloop.ptr_A = static_cast<ElementA const*>(A);
  args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(M, K, 1));
  args.mainloop.ptr_B = static_cast<ElementB const*>(B);
  args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(N, K, 1));

  args.epilogue.thread.alpha = ElementCompute(1);
  args.epilogue.thread.beta = ElementCompute(0);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(M, N, 1));
  args.epilogue.ptr_D = static_cast<ElementD*>(D);
  args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(M, N, 1));

  args.hw_info.device_id = device;
  args.hw_info.sm_count = facts.sm_count;
  args.hw_info.max_active_clusters = facts.max_active_clusters;

  args.scheduler.max_swizzle_size = 8;
  args.scheduler.raster_order = RasterOrderOptions::AlongN;
  return args;
}

inline bool shape_ok(int M, int N, int K) {
  return M > 0 && N > 0 && K > 0;
}

inline bool aligned16(void const* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
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
  auto args = make_arguments(nullptr, nullptr, nullptr, M, N, K, device, facts);
  return Gemm::get_workspace_size(args);
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
  auto args = make_arguments(A, B, C, M, N, K, device, facts);
  // Row strides must be multiples of 16 bytes for TMA (K % 8, and N % 8 where N is a row length).
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) {
    return 4;
  }
  size_t const needed = Gemm::get_workspace_size(args);
  if (needed > 0 && (workspace == nullptr || workspace_bytes < needed || !aligned16(workspace))) {
    return 5;
  }
  void* ws = needed > 0 ? workspace : nullptr;
  // Stream-K: zeroes its tile counters / partial-sum flags with cudaMemsetAsync on `stream`.
  if (GemmKernel::initialize_workspace(args, ws, stream, nullptr) != cutlass::Status::kSuccess) {
    return 6;
  }
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, ws);
  if (Gemm::run(params, stream) != cutlass::Status::kSuccess) {
    return 7;
  }
  return 0;
}

// Kernels that differ from one another in one property each, for scripts/protocol_probe.py
// --timeline --synthetic: which property of a GEMM kernel makes its call read longer in the
// protocol's graph (behind a neighbour kernel) than by CUPTI (each call behind calls of its own).
// Our persistent sm90_cutlass kernels (384 threads, 168 registers, setmaxnreg, 200+ KiB of shared
// memory, TMA) read 0.3-0.45 us more there under 8 us, its non-persistent one and sm90_splitk
// 0.1-0.3, sm80_mma about 0.05 and the library about none. Every kernel here runs one CTA per SM
// for about `cycles` SM clocks, then thread 0 of each CTA writes one word.
//
//   base      128 threads, few registers, no shared memory
//   smem      base + 220 KiB of dynamic shared memory, touched once
//   threads   384 threads
//   regs      384 threads held at 168 registers (launch bounds) with 120 values live across the wait
//   setmaxnreg  regs + the register hand-over of CUTLASS's warp-specialised kernels (sm_90a)
//   code      base + 45 KiB of straight-line code run once after the wait (a cold instruction cache;
//             our GEMM libraries hold 50-70 KiB of device code)
//   all       384 threads, 168 registers, setmaxnreg, 220 KiB of shared memory
//   tma param   base + one TMA load (a 64x64 fp16 box) through a descriptor passed as a kernel
//             parameter (__grid_constant__, as CUTLASS's and sm90_splitk's are), waited for
//   tma global  the same through a descriptor in global memory, written once at set-up
//
// A library: probe_setup(cycles) allocates what the kernels use and returns how many there are,
// probe_name(i) names kernel i, probe_launch(i, stream) launches it (0 on success).
//   nvcc -O3 -shared -Xcompiler -fPIC -arch=sm_90a -o launch_probe.so benchmarks/launch_probe.cu
#include <cstdint>
#include <cuda.h>  // CUtensorMap and its encoder's types (the encoder itself is found at run time)
#include <cuda_runtime.h>

namespace {

__device__ __forceinline__ void wait_cycles(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__device__ __forceinline__ void mark(int* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = 1;
}

// 120 values live across the wait: the kernel needs (and under launch bounds of 384 threads and
// one block an SM, ptxas may give it up to) 168 registers.
__device__ __forceinline__ void hold_registers(int* out, long long cycles, int never) {
  float r[120];
#pragma unroll
  for (int i = 0; i < 120; ++i) r[i] = __int2float_rn(threadIdx.x * (i + 1));
  wait_cycles(cycles);
#pragma unroll
  for (int i = 0; i < 120; ++i) r[i] = fmaf(r[i], r[(i + 7) % 120], 1.0f);
  if (never) {
#pragma unroll
    for (int i = 0; i < 120; ++i) out[gridDim.x + i] = __float2int_rn(r[i]);
  }
}

// CUTLASS's warp-specialised kernels: the producer warpgroup gives registers back and waits,
// the two consumer warpgroups take them (40 and 232 of the 168 each thread starts with) and
// hold their values across the wait.
__device__ __forceinline__ void hand_over_registers(int* out, long long cycles, int never) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH_FEAT_SM90_ALL
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    wait_cycles(cycles);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    hold_registers(out, cycles, never);
  }
#else
  hold_registers(out, cycles, never);
#endif
}

__device__ __forceinline__ void touch_shared(int* out) {
  extern __shared__ int shared[];
  shared[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = shared[blockDim.x - 1] > 0;
}

// One TMA load of a 64x64 fp16 box into shared memory by thread 0, waited for on an mbarrier.
__device__ __forceinline__ void tma_load_once(const void* map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ alignas(128) unsigned short tile[64 * 64];
  __shared__ alignas(8) unsigned long long barrier;
  if (threadIdx.x == 0) {
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(&barrier));
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(tile));
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(64 * 64 * 2) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(map), "r"(0), "r"(static_cast<int>(blockIdx.x % 16) * 64), "r"(bar) : "memory");
    unsigned done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
          : "=r"(done) : "r"(bar) : "memory");
    }
  }
  __syncthreads();
#endif
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128, 1) probe_base(int* out, long long cycles, int never) {
  wait_cycles(cycles);
  mark(out);
}

extern "C" __global__ void __launch_bounds__(128, 1) probe_smem(int* out, long long cycles, int never) {
  wait_cycles(cycles);
  touch_shared(out);
}

extern "C" __global__ void __launch_bounds__(384, 1) probe_threads(int* out, long long cycles, int never) {
  wait_cycles(cycles);
  mark(out);
}

extern "C" __global__ void __launch_bounds__(384, 1) probe_regs(int* out, long long cycles, int never) {
  hold_registers(out, cycles, never);
  mark(out);
}

extern "C" __global__ void __launch_bounds__(384, 1) probe_setmaxnreg(int* out, long long cycles, int never) {
  hand_over_registers(out, cycles, never);
  mark(out);
}

extern "C" __global__ void __launch_bounds__(128, 1) probe_code(int* out, long long cycles, int never) {
  wait_cycles(cycles);
  // 1536 dependent FMAs of distinct immediates (16 bytes of code each), never folded together.
  float x = __int2float_rn(threadIdx.x);
#pragma unroll
  for (int i = 0; i < 1536; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x) : "f"(1.0f + i * 1e-7f), "f"(i * 1e-3f));
  if (never) out[gridDim.x] = __float2int_rn(x);
  mark(out);
}

extern "C" __global__ void __launch_bounds__(384, 1) probe_all(int* out, long long cycles, int never) {
  hand_over_registers(out, cycles, never);
  touch_shared(out);
}

extern "C" __global__ void __launch_bounds__(128, 1) probe_tma_param(const __grid_constant__ CUtensorMap map, int* out,
                                                                     long long cycles, int never) {
  tma_load_once(&map);
  wait_cycles(cycles);
  mark(out);
}

extern "C" __global__ void __launch_bounds__(128, 1) probe_tma_global(const CUtensorMap* map, int* out,
                                                                      long long cycles, int never) {
  tma_load_once(map);
  wait_cycles(cycles);
  mark(out);
}

// ---- host side ----------------------------------------------------------------------------------

namespace {

using Plain = void (*)(int*, long long, int);
enum class Descriptor { none, param, global };  // the TMA kernels' descriptor, and where it lives
struct Probe {
  const char* name;
  Plain kernel;  // null for the TMA kernels
  int threads;
  int smem;
  Descriptor descriptor;
};
const Probe kProbes[] = {
    {"base", probe_base, 128, 0, Descriptor::none},
    {"smem", probe_smem, 128, 220 << 10, Descriptor::none},
    {"threads", probe_threads, 384, 0, Descriptor::none},
    {"regs", probe_regs, 384, 0, Descriptor::none},
    {"setmaxnreg", probe_setmaxnreg, 384, 0, Descriptor::none},
    {"code", probe_code, 128, 0, Descriptor::none},
    {"all", probe_all, 384, 220 << 10, Descriptor::none},
    {"tma param", nullptr, 128, 0, Descriptor::param},
    {"tma global", nullptr, 128, 0, Descriptor::global},
};
constexpr int kCount = sizeof(kProbes) / sizeof(kProbes[0]);

struct State {
  int* out = nullptr;
  unsigned short* source = nullptr;  // 1024 x 64 fp16, the TMA loads' source
  CUtensorMap map{};
  CUtensorMap* map_global = nullptr;
  long long cycles = 0;
  int sms = 0;
} state;

using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                            const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

}  // namespace

// Allocates the kernels' buffers and the TMA descriptors; returns the number of kernels, or a
// negative number where a step failed.
extern "C" int probe_setup(long long cycles) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&state.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return -1;
  }
  state.cycles = cycles;
  if (cudaMalloc(&state.out, (state.sms + 128) * sizeof(int)) != cudaSuccess ||
      cudaMalloc(&state.source, 1024 * 64 * sizeof(unsigned short)) != cudaSuccess ||
      cudaMemset(state.source, 0, 1024 * 64 * sizeof(unsigned short)) != cudaSuccess ||
      cudaMalloc(&state.map_global, sizeof(CUtensorMap)) != cudaSuccess) {
    return -2;
  }
  void* encode = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode, 12000, cudaEnableDefault, &found) !=
          cudaSuccess || found != cudaDriverEntryPointSuccess) {
    return -3;
  }
  const cuuint64_t dims[2] = {64, 1024}, strides[1] = {64 * sizeof(unsigned short)};
  const cuuint32_t box[2] = {64, 64}, steps[2] = {1, 1};
  if (reinterpret_cast<Encode>(encode)(&state.map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, state.source, dims, strides, box,
                                       steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) !=
      CUDA_SUCCESS) {
    return -4;
  }
  if (cudaMemcpy(state.map_global, &state.map, sizeof(CUtensorMap), cudaMemcpyHostToDevice) != cudaSuccess) return -5;
  for (const Probe& probe : kProbes) {
    if (probe.smem && cudaFuncSetAttribute(reinterpret_cast<const void*>(probe.kernel),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, probe.smem) != cudaSuccess) {
      return -6;
    }
  }
  return kCount;
}

extern "C" const char* probe_name(int i) { return i >= 0 && i < kCount ? kProbes[i].name : nullptr; }

// Launches kernel i on `stream`, one CTA an SM; 0 on success.
extern "C" int probe_launch(int i, void* stream) {
  if (i < 0 || i >= kCount || !state.out) return -1;
  const Probe& probe = kProbes[i];
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (probe.descriptor) {
    case Descriptor::none:
      probe.kernel<<<state.sms, probe.threads, probe.smem, s>>>(state.out, state.cycles, 0);
      break;
    case Descriptor::param:
      probe_tma_param<<<state.sms, probe.threads, 0, s>>>(state.map, state.out, state.cycles, 0);
      break;
    case Descriptor::global:
      probe_tma_global<<<state.sms, probe.threads, 0, s>>>(state.map_global, state.out, state.cycles, 0);
      break;
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

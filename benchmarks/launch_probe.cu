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
//
//   nvcc -O3 -cubin -arch=sm_90a -o launch_probe.cubin benchmarks/launch_probe.cu
#include <cstdint>

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

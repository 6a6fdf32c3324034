// How many CTAs launched in thread-block clusters run at once, one CTA an SM: the runtime's
// cudaOccupancyMaxActiveClusters for clusters of 1 to 16 CTAs of a kernel taking SMEM bytes of
// shared memory (default: the opt-in maximum), then the SMs (%smid) each cluster of one launch of
// 16-CTA clusters ran on: a cluster's CTAs share a GPC, so this lists the GPCs. The runtime's
// count is the independent check of cudal2.measure.environment.measure_cluster_slots (the driver's;
// tests/test_gpu.py compares them). Last, where the CTAs of one launch land: grids of 72, 96
// and 128 CTAs in clusters of 1, 2, 4 and 8, each CTA holding its SM for 50 us, counted per GPC
// (the GPCs are the SM groups of the 16-CTA clusters; SMs in none of them count as "?"), with
// the SMs that ran two of the launch's CTAs, one after the other.
//   nvcc -O2 -arch=sm_90a -o cluster_slots benchmarks/cluster_slots.cu && ./cluster_slots [SMEM]
// prints "cluster C: N clusters, S CTAs" per size, then one line of SM ids per cluster, then
// "placement: cluster C, G CTAs: per GPC a b c ... ?, SMs twice T".
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <vector>

__global__ void where(int* out, long long hold_ns) {  // its dynamic shared memory is asked for, not used
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (threadIdx.x == 0) out[blockIdx.x] = int(sm);
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); while ((long long)(now - start) < hold_ns);
}

static cudaLaunchConfig_t config(int cluster, int clusters, int smem, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cluster * clusters);
  cfg.blockDim = dim3(128);
  cfg.dynamicSmemBytes = smem;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = cluster;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  cfg.attrs = attribute;
  cfg.numAttrs = 1;
  return cfg;
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return 1;
  int smem = argc > 1 ? atoi(argv[1]) : int(prop.sharedMemPerBlockOptin);
  cudaFuncSetAttribute(where, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(where, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  printf("%s: %d SMs, %d bytes of shared memory a CTA\n", prop.name, prop.multiProcessorCount, smem);
  for (int cluster : {1, 2, 3, 4, 6, 8, 16}) {
    cudaLaunchAttribute attribute;
    cudaLaunchConfig_t cfg = config(cluster, 1, smem, &attribute);
    int clusters = 0;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, (void*)where, &cfg);
    printf("cluster %d: %d clusters, %d CTAs%s%s\n", cluster, clusters, clusters * cluster, e ? " " : "",
           e ? cudaGetErrorString(e) : "");
  }
  int const cluster = 16, clusters = 16;
  int* ids;
  cudaMalloc(&ids, cluster * clusters * sizeof(int));
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t cfg = config(cluster, clusters, smem, &attribute);
  cudaError_t e = cudaLaunchKernelEx(&cfg, where, ids, 0LL);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("clusters of %d: %s\n", cluster, cudaGetErrorString(e));
    return 0;
  }
  int host[cluster * clusters];
  cudaMemcpy(host, ids, sizeof host, cudaMemcpyDeviceToHost);
  for (int i = 0; i < cluster * clusters; ++i) printf("%d%s", host[i], (i + 1) % cluster ? " " : "\n");
  std::vector<int> gpc(prop.multiProcessorCount, -1);  // an SM's GPC: the first 16-CTA cluster it ran in
  int gpcs = 0;
  for (int c = 0; c < clusters; ++c) {
    int found = -1;
    for (int i = 0; i < cluster && found < 0; ++i) found = gpc[host[c * cluster + i]];
    if (found < 0) found = gpcs++;
    for (int i = 0; i < cluster; ++i) gpc[host[c * cluster + i]] = found;
  }
  int* placed;
  cudaMalloc(&placed, 128 * sizeof(int));
  for (int size : {1, 2, 4, 8}) {
    for (int grid : {72, 96, 128}) {
      cudaLaunchAttribute a;
      cudaLaunchConfig_t launch = config(size, grid / size, smem, &a);
      if (cudaLaunchKernelEx(&launch, where, placed, 50000LL) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
        continue;
      int sms[128];
      cudaMemcpy(sms, placed, sizeof sms, cudaMemcpyDeviceToHost);
      std::vector<int> per(gpcs + 1, 0), seen(prop.multiProcessorCount, 0);
      int twice = 0;
      for (int i = 0; i < grid; ++i) {
        per[gpc[sms[i]] < 0 ? gpcs : gpc[sms[i]]]++;
        twice += seen[sms[i]]++ == 1;
      }
      printf("placement: cluster %d, %d CTAs: per GPC", size, grid);
      for (int g = 0; g < gpcs; ++g) printf(" %d", per[g]);
      printf(" ? %d, SMs twice %d\n", per[gpcs], twice);
    }
  }
  return 0;
}

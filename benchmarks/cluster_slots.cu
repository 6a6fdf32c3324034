// How many CTAs launched in thread-block clusters run at once, one CTA an SM: the runtime's
// cudaOccupancyMaxActiveClusters for clusters of 1 to 16 CTAs of a kernel taking SMEM bytes of
// shared memory (default: the opt-in maximum), then the SMs (%smid) each cluster of one launch of
// 16-CTA clusters ran on: a cluster's CTAs share a GPC, so this lists the GPCs. The runtime's
// count is the independent check of cudal2.environment.measure_cluster_slots (the driver's;
// tests/test_gpu.py compares them).
//   nvcc -O2 -arch=sm_90a -o cluster_slots benchmarks/cluster_slots.cu && ./cluster_slots [SMEM]
// prints "cluster C: N clusters, S CTAs" per size, then one line of SM ids per cluster.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__global__ void where(int* out) {  // its dynamic shared memory is asked for, not used
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (threadIdx.x == 0) out[blockIdx.x] = int(sm);
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
  cudaError_t e = cudaLaunchKernelEx(&cfg, where, ids);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("clusters of %d: %s\n", cluster, cudaGetErrorString(e));
    return 0;
  }
  int host[cluster * clusters];
  cudaMemcpy(host, ids, sizeof host, cudaMemcpyDeviceToHost);
  for (int i = 0; i < cluster * clusters; ++i) printf("%d%s", host[i], (i + 1) % cluster ? " " : "\n");
  return 0;
}

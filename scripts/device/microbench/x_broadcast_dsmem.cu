// Standalone device probe (session 6, device-runs call 2): not part of lily; nvcc -O3 -arch=sm_90a -std=c++17.
// Microbenchmark: time for N CTAs (256 threads) to bring the same 8 KB vector x into shared memory.
// Variants: plain (every CTA reads all of x from L2), cluster C (each CTA reads 1/C of x and writes
// it into every CTA of its cluster through distributed shared memory, then a cluster barrier).
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
__device__ __forceinline__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }

__global__ void __launch_bounds__(256) plain_k(const float4* x, unsigned long long* st, float* sink) {
  __shared__ float4 s[512];
  unsigned long long t0 = gt();
  float4 a = __ldcg(x + threadIdx.x), b = __ldcg(x + threadIdx.x + 256);
  s[threadIdx.x] = a; s[threadIdx.x + 256] = b;
  __syncthreads();
  unsigned long long t1 = gt();
  if (threadIdx.x == 0) { st[2 * blockIdx.x] = t0; st[2 * blockIdx.x + 1] = t1; }
  if (s[(threadIdx.x * 7) & 511].x == 12345.f) sink[0] = 1.f;
}
template <int C>
__global__ void __launch_bounds__(256) cluster_k(const float4* x, unsigned long long* st, float* sink) {
  __shared__ float4 s[512];
  cg::cluster_group cl = cg::this_cluster();
  unsigned long long t0 = gt();
  const int r = cl.block_rank();
  constexpr int per = 512 / C;   // float4s per CTA
  cl.sync();   // peers must have started (their smem exists) before remote stores
  unsigned long long t0b = gt();
  for (int i = threadIdx.x; i < per; i += 256) {
    float4 v = __ldcg(x + r * per + i);
#pragma unroll
    for (int p = 0; p < C; ++p) {
      float4* dst = cl.map_shared_rank(s, p);
      dst[r * per + i] = v;
    }
  }
  cl.sync();
  unsigned long long t1 = gt();
  if (threadIdx.x == 0) { st[2 * blockIdx.x] = t0; st[2 * blockIdx.x + 1] = t1; }
  if (s[(threadIdx.x * 7) & 511].x == 12345.f) sink[0] = 1.f;
  (void)t0b;
}
int main() {
  float4* x; unsigned long long* st; float* sink;
  cudaMalloc(&x, 8192); cudaMemset(x, 0, 8192); cudaMalloc(&st, 2 * 8 * 1024 * 8); cudaMalloc(&sink, 4);
  std::vector<unsigned long long> h(2 * 8 * 1024);
  auto report = [&](const char* name, int N) {
    cudaMemcpy(h.data(), st, 16 * N, cudaMemcpyDeviceToHost);
    unsigned long long m0 = ~0ull; for (int i = 0; i < N; ++i) m0 = std::min(m0, h[2 * i]);
    std::vector<double> d, e; for (int i = 0; i < N; ++i) { d.push_back((h[2 * i + 1] - h[2 * i]) * 1e-3); e.push_back((h[2 * i + 1] - m0) * 1e-3); }
    std::sort(d.begin(), d.end()); std::sort(e.begin(), e.end());
    printf("%-14s N=%4d  per-CTA x-in-smem median %.2f us max %.2f | since first entry median %.2f max %.2f us\n", name, N, d[N / 2], d[N - 1], e[N / 2], e[N - 1]);
  };
  for (int N : {8, 64, 128, 264, 400, 528}) {
    for (int rep = 0; rep < 3; ++rep) {   // last one reported, L2 warm for x
      plain_k<<<N, 256>>>(x, st, sink); cudaDeviceSynchronize();
    }
    report("plain", N);
    {
      cudaLaunchConfig_t cfg = {}; cfg.gridDim = N; cfg.blockDim = 256;
      cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x = 8; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
      cfg.attrs = at; cfg.numAttrs = 1;
      for (int rep = 0; rep < 3; ++rep) { cudaLaunchKernelEx(&cfg, cluster_k<8>, (const float4*)x, st, sink); cudaDeviceSynchronize(); }
      report("cluster8", N);
      at[0].val.clusterDim.x = 4;
      for (int rep = 0; rep < 3; ++rep) { cudaLaunchKernelEx(&cfg, cluster_k<4>, (const float4*)x, st, sink); cudaDeviceSynchronize(); }
      report("cluster4", N);
      at[0].val.clusterDim.x = 2;
      for (int rep = 0; rep < 3; ++rep) { cudaLaunchKernelEx(&cfg, cluster_k<2>, (const float4*)x, st, sink); cudaDeviceSynchronize(); }
      report("cluster2", N);
    }
  }
  printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
}

// Standalone device probe (session 6, device-runs call 5): not part of lily; nvcc -O3 --generate-code=arch=compute_90a,code=sm_90a -std=c++17.
// Microbenchmark: all N CTAs released at once (spin on a flag, like a PDL wait) then bring the same
// x (8 or 16 KB) into shared memory. plain: every CTA loads x from L2 (N * |x| bytes of L2 reads);
// mcC: clusters of C CTAs, each CTA issues a TMA bulk copy of 1/C of x multicast to all C CTAs
// (N/C * |x| bytes of L2 reads), completion on each CTA's own mbarrier.
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstdint>
__device__ __forceinline__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ uint32_t sa(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

template <int XB>
__global__ void __launch_bounds__(256) plain_k(const float4* x, volatile int* flag, unsigned long long* st, float* sink) {
  __shared__ float4 s[XB / 16];
  if (blockIdx.x == 0 && threadIdx.x == 0) { unsigned long long t = gt(); while (gt() - t < 20000) {} *flag = 1; }
  while (*flag == 0) {}
  unsigned long long t0 = gt();
  float4 v[XB / 16 / 256];
#pragma unroll
  for (int k = 0; k < XB / 16 / 256; ++k) v[k] = __ldcg(x + threadIdx.x + 256 * k);
#pragma unroll
  for (int k = 0; k < XB / 16 / 256; ++k) s[threadIdx.x + 256 * k] = v[k];
  __syncthreads();
  unsigned long long t1 = gt();
  if (threadIdx.x == 0) { st[2 * blockIdx.x] = t0; st[2 * blockIdx.x + 1] = t1; }
  if (s[(threadIdx.x * 7) % (XB / 16)].x == 12345.f) sink[0] = 1.f;
}
template <int XB, int C>
__global__ void __launch_bounds__(256) mc_k(const float4* x, volatile int* flag, unsigned long long* st, float* sink) {
  __shared__ __align__(128) float4 s[XB / 16];
  __shared__ __align__(8) unsigned long long bar;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (threadIdx.x == 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bar)), "r"(XB) : "memory");
  if (blockIdx.x == 0 && threadIdx.x == 0) { unsigned long long t = gt(); while (gt() - t < 20000) {} *flag = 1; }
  while (*flag == 0) {}
  unsigned long long t0 = gt();
  if (threadIdx.x == 0) {
    constexpr int part = XB / C;
    const uint16_t mask = uint16_t((1u << C) - 1);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
        ::"r"(sa(s) + rank * part), "l"(reinterpret_cast<const char*>(x) + rank * part), "r"(part), "r"(sa(&bar)), "h"(mask)
        : "memory");
  }
  // wait for phase 0
  asm volatile(
      "{\n.reg .pred p;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n@!p bra W_%=;\n}\n" ::"r"(sa(&bar))
      : "memory");
  unsigned long long t1 = gt();
  if (threadIdx.x == 0) { st[2 * blockIdx.x] = t0; st[2 * blockIdx.x + 1] = t1; }
  for (int i = threadIdx.x; i < XB / 16; i += 256)
    if (s[i].x != float(4 * i) || s[i].w != float(4 * i + 3)) atomicAdd(reinterpret_cast<int*>(sink) + 1, 1);
  // no CTA of the cluster may exit while a peer's copy into it could still be in flight: every CTA
  // waited for its own full x above, so a final cluster barrier suffices.
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
int main() {
  float4* x; unsigned long long* st; float* sink; int* flag;
  cudaMalloc(&x, 16384); cudaMalloc(&st, 2 * 8 * 1024 * 8); cudaMalloc(&sink, 8); cudaMemset(sink, 0, 8); cudaMalloc(&flag, 4);
  std::vector<float> hx(4096); for (int i = 0; i < 4096; ++i) hx[i] = float(i);
  cudaMemcpy(x, hx.data(), 16384, cudaMemcpyHostToDevice);
  std::vector<unsigned long long> h(2 * 8 * 1024);
  auto report = [&](const char* name, int XB, int N) {
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); return; }
    cudaMemcpy(h.data(), st, 16 * N, cudaMemcpyDeviceToHost);
    unsigned long long m0 = ~0ull; for (int i = 0; i < N; ++i) m0 = std::min(m0, h[2 * i]);
    std::vector<double> d; for (int i = 0; i < N; ++i) d.push_back((h[2 * i + 1] - m0) * 1e-3);
    std::sort(d.begin(), d.end());
    printf("%-6s x=%5d B N=%4d  x in smem after release: median %.2f us  p90 %.2f  max %.2f\n", name, XB, N, d[N / 2], d[N * 9 / 10], d[N - 1]);
  };
  auto run_mc = [&](auto kern, int C, int N) {
    cudaLaunchConfig_t cfg = {}; cfg.gridDim = N; cfg.blockDim = 256;
    cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x = C; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    cudaMemset(flag, 0, 4);
    cudaLaunchKernelEx(&cfg, kern, (const float4*)x, (volatile int*)flag, st, sink);
  };
  for (int rep = 0; rep < 2; ++rep)
  for (int N : {256, 264, 392}) {
    cudaMemset(flag, 0, 4); plain_k<8192><<<N, 256>>>(x, flag, st, sink); report("plain", 8192, N);
    run_mc(mc_k<8192, 2>, 2, N); report("mc2", 8192, N);
    run_mc(mc_k<8192, 4>, 4, N); report("mc4", 8192, N);
    run_mc(mc_k<8192, 8>, 8, N); report("mc8", 8192, N);
    cudaMemset(flag, 0, 4); plain_k<16384><<<N, 256>>>(x, flag, st, sink); report("plain", 16384, N);
    run_mc(mc_k<16384, 2>, 2, N); report("mc2", 16384, N);
    run_mc(mc_k<16384, 4>, 4, N); report("mc4", 16384, N);
  }
  int bad[2]; cudaMemcpy(bad, sink, 8, cudaMemcpyDeviceToHost);
  printf("multicast copies: %d wrong float4s\n", bad[1]);
  printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
}

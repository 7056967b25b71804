// Token selection on the device (D2): a two-level argmax whose last block writes the id straight
// into the next step's input slot, the device-side position increment, and a random fill used by
// the benchmark to stand in for a long prefill.
#include "backend/cuda/cuda_ops.h"

namespace lily::cuda {

namespace {

constexpr int kArgBlocks = 64;   // partial blocks per row

// Total order on floats packed with the inverted index: max key = max value, lowest index on ties.
__device__ __forceinline__ unsigned long long arg_key(float v, int i) {
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xFFFFFFFFu - uint32_t(i));
}

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long k) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long other = __shfl_xor_sync(0xffffffffu, k, o);
    k = other > k ? other : k;
  }
  return k;
}

__device__ unsigned long long block_max_key(unsigned long long k, unsigned long long* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  k = warp_max_key(k);
  if (lane == 0) red[wid] = k;
  __syncthreads();
  k = lane < int(blockDim.x >> 5) ? red[lane] : 0ull;
  return warp_max_key(k);
}

// scratch: keys [T][kArgBlocks] then counters [T] (u32, zero between launches).
__global__ void __launch_bounds__(256) argmax_kernel(const float* logits, int n, int32_t* ids,
                                                     unsigned long long* keys, unsigned* counters) {
  __shared__ unsigned long long red[8];
  __shared__ bool last;
  pdl_trigger();
  pdl_wait();
  const int t = blockIdx.y;
  const float* row = logits + int64_t(t) * n;
  const int per = (n + gridDim.x - 1) / gridDim.x;
  const int lo = blockIdx.x * per, hi = min(n, lo + per);
  unsigned long long best = 0ull;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    unsigned long long k = arg_key(row[i], i);
    best = k > best ? k : best;
  }
  best = block_max_key(best, red);
  if (threadIdx.x == 0) {
    keys[int64_t(t) * gridDim.x + blockIdx.x] = best;
    __threadfence();
    last = atomicAdd(&counters[t], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  unsigned long long k = threadIdx.x < gridDim.x
                             ? __ldcg(&keys[int64_t(t) * gridDim.x + threadIdx.x]) : 0ull;
  __syncthreads();
  k = block_max_key(k, red);
  if (threadIdx.x == 0) {
    ids[t] = int32_t(0xFFFFFFFFu - uint32_t(k & 0xFFFFFFFFull));
    counters[t] = 0u;
  }
}

__global__ void increment_kernel(int32_t* p, int by) {
  pdl_trigger();
  pdl_wait();
  *p += by;
}

__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__global__ void fill_uniform_kernel(float* p, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + uint64_t(i) * 0x9E3779B97F4A7C15ull;   // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = scale * (float(uint32_t(z >> 40)) * (2.f / 16777216.f) - 1.f);
  }
}

}  // namespace

int64_t argmax_scratch_bytes(int T) {
  return int64_t(T) * kArgBlocks * 8 + int64_t(T) * 4 + 16;
}

void argmax(const float* logits, int T, int n, int32_t* ids, void* scratch, cudaStream_t s) {
  auto* keys = static_cast<unsigned long long*>(scratch);
  auto* counters = reinterpret_cast<unsigned*>(keys + int64_t(T) * kArgBlocks);
  dim3 grid(kArgBlocks, T);
  launch(argmax_kernel, grid, dim3(256), 0, s, logits, n, ids, keys, counters);
  CUDA_LAUNCH_CHECK();
}

void increment(int32_t* p, int by, cudaStream_t s) {
  launch(increment_kernel, dim3(1), dim3(1), 0, s, p, by);
  CUDA_LAUNCH_CHECK();
}

void spin(uint64_t ns, cudaStream_t s) {
  spin_kernel<<<1, 1, 0, s>>>(ns);
  CUDA_LAUNCH_CHECK();
}

void fill_uniform(float* p, int64_t n, float scale, uint64_t seed, cudaStream_t s) {
  fill_uniform_kernel<<<1024, 256, 0, s>>>(p, n, scale, seed);
  CUDA_LAUNCH_CHECK();
}

}  // namespace lily::cuda

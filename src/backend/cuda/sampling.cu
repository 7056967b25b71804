// The sample op on the device (D2): penalties, temperature, top-k, top-p, min-p and one seeded
// draw in three graph-capturable kernels with no host synchronisation, picking exactly the id the
// cpu backend picks (the rule is in docs/CUDA.md "Sampling on the device"; arithmetic in
// backend/sample_math.h). Each kernel's last block to finish does the serial part ("last block
// done" counter), so the op is:
//   prep    penalised logits -> 32-bit order keys, global maximum; greedy finishes here.
//   hist    weights (2^44 fixed point, exact sums) into a 2048-bin histogram over the tempered
//           logit x in [-30, 0]; plain / min-p-only sampling draws here (index order); otherwise
//           the last block finds the bin range [0, B] that must hold the kept tokens.
//   select  gathers the tokens of bins [0, B] (<= kCap of them), sorts them by key in shared
//           memory and takes top-k, top-p, min-p and the draw as prefix positions; when more than
//           kCap tokens lie there (flat distributions), an exact radix descent over all keys does
//           the same in one block (slow but rare).
#include "backend/cuda/cuda_ops.h"
#include "backend/sample_math.h"

namespace lily::cuda {

namespace {

using namespace lily::smath;
using u64 = unsigned long long;

constexpr int kThreads = 1024;
constexpr int kChunk = 4096;                    // tokens per block (4 per thread)
constexpr int kBins = 2048;
constexpr float kBinScale = float(kBins) / 30.0f;   // bins over x in [-30, 0]
constexpr int kCap = 4096;                      // sorted-path capacity
constexpr int kSelectSmem = 2 * kCap * 8;       // keys + cumulative weights

struct Ctl {
  uint32_t max_key;
  int32_t argmax;
  int32_t path;       // 0 done, 1 continue after prep, 2 sorted, 3 radix fallback
  int32_t B;
  uint32_t kp;        // smallest key of a candidate (weight > 0)
  int32_t k_eff;
  int32_t C;
  float inv_t;
  u64 z_total;
  uint32_t counter[3];
  uint32_t list_n;
  int32_t taken;      // how the last pick was made (path code; 0 = greedy, 1 = index order)
};

struct Ws {
  Ctl* ctl;
  uint32_t* keys;      // [n]
  u64* bmax;           // [nb]
  u64* bsum_all;       // [nb]
  u64* bsum_kept;      // [nb]
  uint32_t* hcnt;      // [kBins]
  u64* hmass;          // [kBins]
  uint32_t* list;      // [kCap]
};

__host__ __device__ inline int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }
__host__ __device__ inline int num_blocks(int n) { return (n + kChunk - 1) / kChunk; }

// Byte offsets of the workspace parts; returns the total size. The parts that must stay zero
// between calls (control block, histogram) come first, at offsets independent of n.
__host__ __device__ inline int64_t ws_layout(void* base, int n, Ws* w) {
  const int nb = num_blocks(n);
  int64_t off[9];
  const int64_t sizes[8] = {int64_t(sizeof(Ctl)), 4LL * kBins, 8LL * kBins, 4LL * kCap,
                            8LL * nb, 8LL * nb, 8LL * nb, 4LL * n};
  off[0] = 0;
  for (int i = 0; i < 8; ++i) off[i + 1] = off[i] + align16(sizes[i]);
  if (w) {
    char* p = static_cast<char*>(base);
    w->ctl = reinterpret_cast<Ctl*>(p + off[0]);
    w->hcnt = reinterpret_cast<uint32_t*>(p + off[1]);
    w->hmass = reinterpret_cast<u64*>(p + off[2]);
    w->list = reinterpret_cast<uint32_t*>(p + off[3]);
    w->bmax = reinterpret_cast<u64*>(p + off[4]);
    w->bsum_all = reinterpret_cast<u64*>(p + off[5]);
    w->bsum_kept = reinterpret_cast<u64*>(p + off[6]);
    w->keys = reinterpret_cast<uint32_t*>(p + off[7]);
  }
  return off[8];
}

__device__ __forceinline__ int x_bin(float x) { return min(kBins - 1, int(f_mul(-x, kBinScale))); }

// ---- block helpers (blockDim.x == kThreads) -------------------------------------------------
__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u64 y = __shfl_xor_sync(0xffffffffu, v, o);
    v = y > v ? y : v;
  }
  return v;
}
__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// All threads get the result; `red` holds >= 32 values.
__device__ u64 block_max_u64(u64 v, u64* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  v = warp_max_u64(v);
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? red[lane] : 0ull;
  return warp_max_u64(v);
}
__device__ u64 block_sum_u64(u64 v, u64* red) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  v = warp_sum_u64(v);
  __syncthreads();
  if (lane == 0) red[wid] = v;
  __syncthreads();
  v = lane < int(blockDim.x >> 5) ? red[lane] : 0ull;
  return warp_sum_u64(v);
}
// In-place inclusive prefix sum of a[0, S) in shared memory (contiguous runs per thread).
template <class T>
__device__ void block_scan(T* a, int S, T* wsum) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, wid = tid >> 5;
  const int per = (S + nt - 1) / nt;
  const int lo = min(S, tid * per), hi = min(S, lo + per);
  __syncthreads();
  T run = 0;
  for (int j = lo; j < hi; ++j) {
    run += a[j];
    a[j] = run;
  }
  T v = run;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) wsum[wid] = v;
  __syncthreads();
  if (wid == 0) {
    T s = lane < (nt >> 5) ? wsum[lane] : T(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      T y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    wsum[lane] = s;
  }
  __syncthreads();
  const T off = v - run + (wid > 0 ? wsum[wid - 1] : T(0));
  for (int j = lo; j < hi; ++j) a[j] += off;
  __syncthreads();
}

// Records the pick: input slot of the next step, penalty counts, draw counter. One thread.
__device__ void finish(int32_t pick, SampleConfig* cfg, int32_t* counts, int32_t* out, Ctl* ctl, int taken) {
  *out = pick;
  counts[pick] = (counts[pick] | 1) + 2;
  cfg->step += 1;
  ctl->path = 0;
  ctl->taken = taken;
}

// Last-block-done: true in exactly one block, after every block's writes are visible.
__device__ bool arrive_last(uint32_t* counter, bool* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    *flag = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (*flag) __threadfence();
  return *flag;
}

// ---- kernel 1: penalised keys and the maximum -----------------------------------------------
__global__ void __launch_bounds__(kThreads) sample_prep_kernel(const float* logits, int n, SampleConfig* cfg,
                                                               int32_t* counts, int32_t* out, void* wsp) {
  __shared__ int32_t s_bid[kMaxLogitBias];
  __shared__ float s_bv[kMaxLogitBias];
  __shared__ u64 red[32];
  __shared__ bool last;
  pdl_trigger();
  pdl_wait();
  Ws w;
  ws_layout(wsp, n, &w);
  const int nv = cfg->n_valid > 0 && cfg->n_valid < n ? cfg->n_valid : n;
  const int nbias = min(max(cfg->n_bias, 0), kMaxLogitBias);
  if (int(threadIdx.x) < nbias) {
    s_bid[threadIdx.x] = cfg->bias_id[threadIdx.x];
    s_bv[threadIdx.x] = cfg->bias[threadIdx.x];
  }
  const float rep = cfg->repetition_penalty, pres = cfg->presence_penalty, freq = cfg->frequency_penalty;
  __syncthreads();
  u64 best = 0;
  const int base = blockIdx.x * kChunk;
#pragma unroll
  for (int j = 0; j < kChunk / kThreads; ++j) {
    const int i = base + j * kThreads + threadIdx.x;
    if (i >= n) break;
    uint32_t k = 0;
    if (i < nv) {
      float l = logits[i];
      for (int b = 0; b < nbias; ++b)
        if (s_bid[b] == i) l = f_add(l, s_bv[b]);
      k = logit_key(penalise(l, counts[i], rep, pres, freq));
    }
    w.keys[i] = k;
    if (k) best = max(best, u64(full_key(k, uint32_t(i))));
  }
  best = block_max_u64(best, red);
  if (threadIdx.x == 0) w.bmax[blockIdx.x] = best;
  if (!arrive_last(&w.ctl->counter[0], &last)) return;
  u64 v = 0;
  for (int b = threadIdx.x; b < int(gridDim.x); b += kThreads) v = max(v, __ldcg(&w.bmax[b]));
  v = block_max_u64(v, red);
  if (threadIdx.x == 0) {
    Ctl* c = w.ctl;
    c->counter[0] = 0;
    const uint32_t mk = uint32_t(v >> 32);
    const int32_t am = v ? int32_t(full_key_id(v)) : 0;
    const float t = cfg->temperature;
    const float inv_t = t > 0.0f ? f_div(1.0f, t) : 0.0f;
    c->max_key = mk;
    c->argmax = am;
    c->inv_t = inv_t;
    if (mk == 0 || t == 0.0f || cfg->top_k == 1 || !(inv_t <= 3.40282347e38f)) {
      finish(am, cfg, counts, out, c, 0);
    } else {
      c->kp = min_key_with_x(mk, inv_t, kXMin);
      c->path = 1;
    }
  }
}

// ---- kernel 2: weight histogram; plain draws; the gather range ------------------------------
__global__ void __launch_bounds__(kThreads) sample_hist_kernel(int n, SampleConfig* cfg, int32_t* counts,
                                                               int32_t* out, void* wsp) {
  // Per-block histogram: counts and the weights as three 15-bit limbs (32-bit shared atomics are
  // native; 64-bit ones would be CAS loops under heavy contention). The last block reuses the limb
  // space for the global 64-bit masses.
  __shared__ __align__(16) uint32_t s_raw[4 * kBins];
  uint32_t* s_cnt = s_raw;
  uint32_t* s_limb = s_raw + kBins;   // [3][kBins]
  u64* s_mass = reinterpret_cast<u64*>(s_raw + 2 * kBins);
  __shared__ u64 red[32];
  __shared__ u64 s_u64[2];
  __shared__ int s_int[2];
  __shared__ bool last;
  pdl_trigger();
  pdl_wait();
  Ws w;
  ws_layout(wsp, n, &w);
  Ctl* ctl = w.ctl;
  if (ctl->path != 1) return;
  const uint32_t mk = ctl->max_key, kp = ctl->kp;
  const float inv_t = ctl->inv_t, lmin = cfg->log_min_p;
  for (int b = threadIdx.x; b < 4 * kBins; b += kThreads) s_raw[b] = 0;
  __syncthreads();
  u64 all = 0, kept = 0;
  const int base = blockIdx.x * kChunk;
#pragma unroll
  for (int j = 0; j < kChunk / kThreads; ++j) {
    const int i = base + j * kThreads + threadIdx.x;
    if (i >= n) break;
    const uint32_t k = w.keys[i];
    if (k < kp) continue;
    const float x = rel_x(k, mk, inv_t);
    const u64 wt = weight(x);
    const int b = x_bin(x);
    atomicAdd(&s_cnt[b], 1u);
    const uint32_t l0 = uint32_t(wt) & 0x7FFFu, l1 = uint32_t(wt >> 15) & 0x7FFFu, l2 = uint32_t(wt >> 30);
    if (l0) atomicAdd(&s_limb[b], l0);
    if (l1) atomicAdd(&s_limb[kBins + b], l1);
    if (l2) atomicAdd(&s_limb[2 * kBins + b], l2);
    all += wt;
    if (x >= lmin) kept += wt;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (s_cnt[b]) {
      atomicAdd(&w.hcnt[b], s_cnt[b]);
      atomicAdd(&w.hmass[b], u64(s_limb[b]) + (u64(s_limb[kBins + b]) << 15) + (u64(s_limb[2 * kBins + b]) << 30));
    }
  all = block_sum_u64(all, red);
  kept = block_sum_u64(kept, red);
  if (threadIdx.x == 0) {
    w.bsum_all[blockIdx.x] = all;
    w.bsum_kept[blockIdx.x] = kept;
  }
  if (!arrive_last(&ctl->counter[1], &last)) return;

  // ---- last block ----
  const int nb = gridDim.x;
  u64 z = 0, tk = 0;
  for (int b = threadIdx.x; b < nb; b += kThreads) {
    z += __ldcg(&w.bsum_all[b]);
    tk += __ldcg(&w.bsum_kept[b]);
  }
  z = block_sum_u64(z, red);
  tk = block_sum_u64(tk, red);
  for (int b = threadIdx.x; b < kBins; b += kThreads) {   // take the histogram, leave it zeroed
    s_cnt[b] = __ldcg(&w.hcnt[b]);
    s_mass[b] = __ldcg(&w.hmass[b]);
    w.hcnt[b] = 0;
    w.hmass[b] = 0;
  }
  __syncthreads();
  uint32_t np = 0;
  for (int b = threadIdx.x; b < kBins; b += kThreads) np += s_cnt[b];
  np = uint32_t(block_sum_u64(np, red));
  const int top_k = cfg->top_k;
  const int k_eff = top_k > 0 && uint32_t(top_k) < np ? top_k : 0;
  const float top_p = cfg->top_p;
  if (threadIdx.x == 0) ctl->counter[1] = 0;
  if (k_eff == 0 && !(top_p < 1.0f)) {
    // Plain (or min-p only) sampling: the draw in index order over the kept weights.
    const u64 u = mulhi64(draw_bits(cfg->seed, cfg->step), tk);
    if (threadIdx.x == 0) {
      u64 acc = 0;
      int bb = nb - 1;
      for (int b = 0; b < nb; ++b) {
        const u64 s = __ldcg(&w.bsum_kept[b]);
        if (acc + s > u) {
          bb = b;
          break;
        }
        acc += s;
      }
      s_int[0] = bb;
      s_u64[0] = u - acc;   // rank inside block bb
      s_int[1] = 0x7FFFFFFF;
    }
    __syncthreads();
    const int bb = s_int[0];
    const u64 rem = s_u64[0];
    u64* cum = s_mass;   // the chunk's kChunk weights are scanned in halves of kBins
    u64 carry = 0;
    for (int half = 0; half < 2; ++half) {
      const int i0 = bb * kChunk + half * kBins;
      for (int t = threadIdx.x; t < kBins; t += kThreads) {
        const int i = i0 + t;
        u64 wt = 0;
        if (i < n) {
          const uint32_t k = w.keys[i];
          if (k >= kp) {
            const float x = rel_x(k, mk, inv_t);
            if (x >= lmin) wt = weight(x);
          }
        }
        cum[t] = wt;
      }
      block_scan(cum, kBins, red);
      for (int t = threadIdx.x; t < kBins; t += kThreads)
        if (carry + cum[t] > rem) atomicMin(&s_int[1], i0 + t);
      carry += cum[kBins - 1];
      __syncthreads();
      if (s_int[1] != 0x7FFFFFFF) break;
    }
    if (threadIdx.x == 0) finish(s_int[1] != 0x7FFFFFFF ? s_int[1] : ctl->argmax, cfg, counts, out, ctl, 1);
    return;
  }
  // Ordered sampling: the kept tokens lie in bins [0, B].
  u64* cm = s_mass;
  block_scan(cm, kBins, red);
  block_scan(s_cnt, kBins, reinterpret_cast<uint32_t*>(red));
  const u64 target = k_eff > 0 ? u64(k_eff) : top_p_target(top_p, z);
  if (threadIdx.x == 0) s_int[0] = kBins - 1;
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    const u64 v = k_eff > 0 ? u64(s_cnt[b]) : cm[b];
    if (v >= target) atomicMin(&s_int[0], b);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int B = s_int[0];
    ctl->B = B;
    ctl->C = int(s_cnt[B]);
    ctl->k_eff = k_eff;
    ctl->z_total = z;
    ctl->list_n = 0;
    ctl->path = s_cnt[B] <= uint32_t(kCap) ? 2 : 3;
  }
}

// ---- kernel 3 helpers -----------------------------------------------------------------------
struct Radix {
  u64 f[256];
  uint32_t c[256];
  u64 mx[256];
  u64 prefix, above, result;
  int done;
};

// Largest full key K with F(>= K) >= target, F summing weights (mass) or 1 (count) over the
// candidates (key >= kp). Exact: radix descent on 8-bit digits, stopping once one token is left.
__device__ u64 radix_quantile(const uint32_t* keys, int n, uint32_t kp, uint32_t mk, float inv_t, bool mass,
                              u64 target, Radix& R) {
  __syncthreads();   // every thread has read the previous call's result
  if (threadIdx.x == 0) {
    R.prefix = 0;
    R.above = 0;
    R.done = 0;
    R.result = 0;
  }
  for (int shift = 56; shift >= 0; shift -= 8) {
    __syncthreads();
    for (int d = threadIdx.x; d < 256; d += kThreads) {
      R.f[d] = 0;
      R.c[d] = 0;
      R.mx[d] = 0;
    }
    __syncthreads();
    const u64 prefix = R.prefix;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t k = __ldcg(&keys[i]);
      if (k < kp) continue;
      const u64 fk = full_key(k, uint32_t(i));
      if (shift < 56 && (fk >> (shift + 8)) != (prefix >> (shift + 8))) continue;
      const int d = int((fk >> shift) & 255u);
      atomicAdd(&R.f[d], mass ? u64(weight(rel_x(k, mk, inv_t))) : 1ull);
      atomicAdd(&R.c[d], 1u);
      atomicMax(&R.mx[d], fk);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u64 acc = R.above;
      int sel = -1;
      for (int d = 255; d >= 0; --d) {
        if (!R.c[d]) continue;
        sel = d;
        if (acc + R.f[d] >= target) break;
        acc += R.f[d];
      }
      // sel == -1 cannot happen for a valid target; the lowest digit is the safe answer then.
      if (sel < 0) {
        R.done = 1;
        R.result = R.prefix;
      } else {
        R.above = acc;
        R.prefix |= u64(sel) << shift;
        if (R.c[sel] == 1 || shift == 0) {
          R.done = 1;
          R.result = R.mx[sel];
        }
      }
    }
    __syncthreads();
    if (R.done) break;
  }
  return R.result;
}

__device__ u64 mass_at_least(const uint32_t* keys, int n, uint32_t kp, uint32_t mk, float inv_t, u64 K, u64* red) {
  u64 s = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const uint32_t k = __ldcg(&keys[i]);
    if (k >= kp && full_key(k, uint32_t(i)) >= K) s += weight(rel_x(k, mk, inv_t));
  }
  return block_sum_u64(s, red);
}

// ---- kernel 3: gather, then top-k / top-p / min-p / draw ------------------------------------
__global__ void __launch_bounds__(kThreads) sample_select_kernel(int n, SampleConfig* cfg, int32_t* counts,
                                                                 int32_t* out, void* wsp) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ u64 red[32];
  __shared__ uint32_t s_n, s_base;
  __shared__ int s_first[3];
  __shared__ bool last;
  pdl_trigger();
  pdl_wait();
  Ws w;
  ws_layout(wsp, n, &w);
  Ctl* ctl = w.ctl;
  const int path = ctl->path;
  if (path < 2) return;
  const uint32_t mk = ctl->max_key, kp = ctl->kp;
  const float inv_t = ctl->inv_t;
  if (path == 2) {
    uint32_t* ids = reinterpret_cast<uint32_t*>(smem);   // up to kChunk
    const int B = ctl->B;
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    const int base = blockIdx.x * kChunk;
    for (int j = 0; j < kChunk / kThreads; ++j) {
      const int i = base + j * kThreads + threadIdx.x;
      if (i >= n) break;
      const uint32_t k = w.keys[i];
      if (k >= kp && x_bin(rel_x(k, mk, inv_t)) <= B) ids[atomicAdd(&s_n, 1u)] = uint32_t(i);
    }
    __syncthreads();
    if (threadIdx.x == 0 && s_n) s_base = atomicAdd(&ctl->list_n, s_n);
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < s_n; j += kThreads)
      if (s_base + j < uint32_t(kCap)) w.list[s_base + j] = ids[j];
  }
  if (!arrive_last(&ctl->counter[2], &last)) return;

  // ---- last block ----
  const int k_eff = ctl->k_eff;
  const float top_p = cfg->top_p, lmin = cfg->log_min_p;
  const u64 r = draw_bits(cfg->seed, cfg->step);
  int32_t pick;
  if (path == 2) {
    const int C = min(min(ctl->C, int(atomicAdd(&ctl->list_n, 0u))), kCap);   // equal unless a bug
    int S = 1;
    while (S < C) S <<= 1;
    u64* sk = reinterpret_cast<u64*>(smem);
    u64* sc = sk + kCap;
    for (int j = threadIdx.x; j < S; j += kThreads) {
      u64 v = 0;
      if (j < C) {
        const uint32_t id = __ldcg(&w.list[j]);
        v = full_key(__ldcg(&w.keys[id]), id);
      }
      sk[j] = v;
    }
    __syncthreads();
    for (int k = 2; k <= S; k <<= 1)   // bitonic sort, descending
      for (int jj = k >> 1; jj > 0; jj >>= 1) {
        for (int i = threadIdx.x; i < S; i += kThreads) {
          const int l = i ^ jj;
          if (l > i) {
            const u64 a = sk[i], b = sk[l];
            const bool desc = (i & k) == 0;
            if (desc ? a < b : a > b) {
              sk[i] = b;
              sk[l] = a;
            }
          }
        }
        __syncthreads();
      }
    for (int j = threadIdx.x; j < S; j += kThreads)
      sc[j] = j < C ? u64(weight(rel_x(uint32_t(sk[j] >> 32), mk, inv_t))) : 0ull;
    block_scan(sc, S, red);
    const int nk = k_eff > 0 ? min(k_eff, C) : C;
    const u64 zz = k_eff > 0 ? sc[nk - 1] : ctl->z_total;
    const u64 target = top_p < 1.0f ? top_p_target(top_p, zz) : 0;
    if (threadIdx.x == 0) {
      s_first[0] = nk - 1;   // top-p: first j with cum >= target
      s_first[1] = nk;       // min-p: first j with x < log(min_p)
      s_first[2] = 0x7FFFFFFF;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < nk; j += kThreads) {
      if (top_p < 1.0f && sc[j] >= target) atomicMin(&s_first[0], j);
      if (j > 0 && !(rel_x(uint32_t(sk[j] >> 32), mk, inv_t) >= lmin)) atomicMin(&s_first[1], j);
    }
    __syncthreads();
    const int keep = min(s_first[0] + 1, s_first[1]);
    const u64 u = mulhi64(r, sc[keep - 1]);
    for (int j = threadIdx.x; j < keep; j += kThreads)
      if (sc[j] > u) atomicMin(&s_first[2], j);
    __syncthreads();
    pick = int32_t(full_key_id(sk[min(s_first[2], keep - 1)]));
  } else {
    Radix& R = *reinterpret_cast<Radix*>(smem);
    const uint32_t* keys = w.keys;
    u64 Kk = 0, z = ctl->z_total;
    if (k_eff > 0) {
      Kk = radix_quantile(keys, n, kp, mk, inv_t, false, u64(k_eff), R);
      z = mass_at_least(keys, n, kp, mk, inv_t, Kk, red);
    }
    u64 Kp = 0;
    if (top_p < 1.0f) Kp = radix_quantile(keys, n, kp, mk, inv_t, true, top_p_target(top_p, z), R);
    const u64 Km = lmin > -INFINITY ? u64(min_key_with_x(mk, inv_t, lmin)) << 32 : 0ull;
    const u64 Kf = max(Kk, max(Kp, Km));
    const u64 total = mass_at_least(keys, n, kp, mk, inv_t, Kf, red);
    const u64 Kc = radix_quantile(keys, n, kp, mk, inv_t, true, mulhi64(r, total) + 1, R);
    pick = int32_t(full_key_id(Kc));
  }
  if (threadIdx.x == 0) {
    ctl->counter[2] = 0;
    ctl->list_n = 0;
    finish(pick, cfg, counts, out, ctl, path);
  }
}

}  // namespace

int64_t sample_workspace_bytes(int n) { return ws_layout(nullptr, n, nullptr); }

int sample_last_path(const void* ws) {
  Ctl c;
  CUDA_CHECK(cudaMemcpy(&c, ws, sizeof(Ctl), cudaMemcpyDeviceToHost));
  return c.taken;
}

void sample(const float* logits, int n, SampleConfig* cfg, int32_t* counts, int32_t* id, void* ws, cudaStream_t s) {
  static bool attr = false;
  if (!attr) {
    CUDA_CHECK(cudaFuncSetAttribute(sample_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSelectSmem));
    attr = true;
  }
  const dim3 grid(num_blocks(n));
  launch(sample_prep_kernel, grid, dim3(kThreads), 0, s, logits, n, cfg, counts, id, ws);
  CUDA_LAUNCH_CHECK();
  launch(sample_hist_kernel, grid, dim3(kThreads), 0, s, n, cfg, counts, id, ws);
  CUDA_LAUNCH_CHECK();
  launch(sample_select_kernel, grid, dim3(kThreads), size_t(kSelectSmem), s, n, cfg, counts, id, ws);
  CUDA_LAUNCH_CHECK();
}

}  // namespace lily::cuda

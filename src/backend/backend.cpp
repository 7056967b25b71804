// Backend factory and the ablation switch set; the only place that names concrete backends.
#include "backend/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "backend/cpu/cpu_backend.h"
#include "core/common.h"
#include "core/options.h"
#ifdef LILY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace lily {

bool Ablations::has(const std::string& id) const {
  return std::find(off.begin(), off.end(), id) != off.end();
}

Ablations Ablations::variant(const std::string& spec) {
  Ablations a;
  for (std::string& id : split_list(spec, '+'))
    if (!a.has(id)) a.off.push_back(std::move(id));
  return a;
}

void Ablations::merge_env(const char* var) {
  const char* e = std::getenv(var);
  if (!e) return;
  const std::string ids = e;
  for (size_t i = 0; i <= ids.size();) {
    const size_t j = std::min(ids.find(',', i), ids.size());
    std::string id = ids.substr(i, j - i);
    id.erase(0, id.find_first_not_of(" \t"));
    id.erase(id.find_last_not_of(" \t") + 1);
    if (!id.empty() && !has(id)) off.push_back(id);
    i = j + 1;
  }
}

SampleConfig make_sample_config(float temperature, float top_p, int top_k, float min_p, float presence,
                                float frequency, float repetition, uint64_t seed, int n_valid) {
  SampleConfig c;
  c.temperature = temperature;
  c.top_p = top_p;
  c.top_k = top_k;
  c.min_p = min_p;
  c.log_min_p = min_p > 0.0f ? std::log(min_p) : -INFINITY;
  c.presence_penalty = presence;
  c.frequency_penalty = frequency;
  c.repetition_penalty = repetition;
  c.seed = seed;
  c.n_valid = n_valid;
  return c;
}

void* Backend::alloc_host(int64_t bytes) {
  void* p = std::calloc(size_t(std::max<int64_t>(bytes, 1)), 1);
  if (!p) throw Error("out of host memory allocating " + std::to_string(bytes) + " bytes");
  return p;
}
void Backend::free_host(void* p) { std::free(p); }

// Backends without a 16-bit cache only ever allocate f32 ones.
void Backend::kv_from_f32(void* dst, KvType t, const float* src, int64_t n) {
  LILY_CHECK(t == KvType::f32, "kv_from_f32: this backend has no 16-bit KV cache");
  copy(dst, src, n * 4);
}
void Backend::kv_to_f32(float* dst, const void* src, KvType t, int64_t n) {
  LILY_CHECK(t == KvType::f32, "kv_to_f32: this backend has no 16-bit KV cache");
  copy(dst, src, n * 4);
}

std::unique_ptr<Backend> make_backend(const BackendOptions& opt) {
  if (opt.name == "cpu") return make_cpu_backend(opt);
  if (opt.name == "cuda") {
#ifdef LILY_HAVE_CUDA
    return make_cuda_backend(opt);
#else
    throw Error("this build of lily has no CUDA backend (configure with nvcc on PATH, LILY_CUDA=ON)");
#endif
  }
  throw Error("unknown backend '" + opt.name + "' (expected cpu or cuda)");
}

}  // namespace lily

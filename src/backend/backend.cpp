// Backend factory and the ablation switch set; the only place that names concrete backends.
#include "backend/backend.h"

#include <algorithm>

#include "backend/cpu/cpu_backend.h"
#include "core/common.h"
#ifdef LILY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace lily {

bool Ablations::has(const std::string& id) const {
  return std::find(off.begin(), off.end(), id) != off.end();
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

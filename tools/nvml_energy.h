// GPU energy and clocks for benchmarks, read through NVML loaded at run time (dlopen of libnvidia-ml.so.1, the
// driver's library): no build or link dependency, and on a machine without an NVIDIA driver ok() is false and the
// readings are absent. Why a benchmark needs it (docs/CUDA.md, session 24): a long prefill on H200 runs at the
// board's power limit, where a kernel that finishes sooner but draws more power can leave the wall time unchanged;
// energy per prefill shows what a change costs when time does not.
#pragma once

#include <dlfcn.h>

namespace lily {

class NvmlEnergy {
 public:
  NvmlEnergy() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) return;
    using InitFn = int (*)();
    using HandleFn = int (*)(unsigned, void**);
    auto init = reinterpret_cast<InitFn>(dlsym(lib_, "nvmlInit_v2"));
    auto handle = reinterpret_cast<HandleFn>(dlsym(lib_, "nvmlDeviceGetHandleByIndex_v2"));
    energy_ = reinterpret_cast<EnergyFn>(dlsym(lib_, "nvmlDeviceGetTotalEnergyConsumption"));
    clock_ = reinterpret_cast<ClockFn>(dlsym(lib_, "nvmlDeviceGetClockInfo"));
    limit_ = reinterpret_cast<LimitFn>(dlsym(lib_, "nvmlDeviceGetEnforcedPowerLimit"));
    unsigned long long mj = 0;
    // Device 0: the benchmarks run on the first visible device (one GPU per machine here).
    ok_ = init && handle && energy_ && init() == 0 && handle(0, &dev_) == 0 && energy_(dev_, &mj) == 0;
  }
  ~NvmlEnergy() {
    if (lib_) {
      if (ok_)
        if (auto shut = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlShutdown"))) shut();
      dlclose(lib_);
    }
  }
  NvmlEnergy(const NvmlEnergy&) = delete;
  NvmlEnergy& operator=(const NvmlEnergy&) = delete;

  bool ok() const { return ok_; }
  // Energy the board has used since the driver loaded, in joules (NVML counts millijoules); -1 without NVML.
  double joules() const {
    unsigned long long mj = 0;
    return ok_ && energy_(dev_, &mj) == 0 ? double(mj) * 1e-3 : -1.0;
  }
  // Current SM clock in MHz (NVML_CLOCK_SM = 1); 0 without NVML.
  unsigned sm_mhz() const {
    unsigned m = 0;
    return ok_ && clock_ && clock_(dev_, 1, &m) == 0 ? m : 0;
  }
  // The enforced board power limit in watts; 0 without NVML.
  double power_limit_w() const {
    unsigned mw = 0;
    return ok_ && limit_ && limit_(dev_, &mw) == 0 ? mw * 1e-3 : 0.0;
  }

 private:
  using EnergyFn = int (*)(void*, unsigned long long*);
  using ClockFn = int (*)(void*, int, unsigned*);
  using LimitFn = int (*)(void*, unsigned*);
  void* lib_ = nullptr;
  void* dev_ = nullptr;
  EnergyFn energy_ = nullptr;
  ClockFn clock_ = nullptr;
  LimitFn limit_ = nullptr;
  bool ok_ = false;
};

}  // namespace lily

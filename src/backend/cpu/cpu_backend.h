// Factory of the CPU backend (the reference and portable default).
#pragma once
#include <memory>

#include "backend/backend.h"

namespace lily {
std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& opt);
}  // namespace lily

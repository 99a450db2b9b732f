// TEST INFRASTRUCTURE: what traffic.cpp needs from the CUDA emulation's runtime.
#pragma once

#include <cstdint>

namespace cuda_emulation {

// True while a grid runs on fibers: the kernel's memory accesses, and only they, are counted.
extern bool counting_global_accesses;

// Whether an address is a thread's or its block's own rather than global memory: the fiber
// stacks, this build's static data (the __shared__ variables, the parameter space) and
// threadIdx.
bool is_private_memory(uintptr_t address);

}  // namespace cuda_emulation

// The CUDA emulation's stand-in for <cuda_runtime_api.h> (see ../cuda_emulation.h).
#pragma once
#include "../cuda_emulation.h"

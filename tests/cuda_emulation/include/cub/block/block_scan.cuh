// The CUDA emulation's stand-in for <cub/block/block_scan.cuh> (see ../../../cuda_emulation.h).
#pragma once
#include "../../../cuda_emulation.h"

// chainer_tc emulator: stand-in for CUDA's <cuda_fp16.h>; the types live in chainer_tc_emu_fp16.h.
#pragma once
#include "chainer_tc_emu.h"

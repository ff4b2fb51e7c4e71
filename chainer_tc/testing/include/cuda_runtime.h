// chainer_tc emulator: stand-in for <cuda_runtime.h>; everything a kernel needs is in chainer_tc_emu.h.
#pragma once
#include "chainer_tc_emu.h"

// The scalar variant of the SIMD kernels (csrc/simd_kernels.h; chosen at load by simd_dispatch.cpp).
#define PYSTRONGHOLD_SIMD_SCALAR 1
#include "simd_kernels.h"

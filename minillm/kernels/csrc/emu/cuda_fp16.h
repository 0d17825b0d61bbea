// The CPU emulator's stand-in for <cuda_fp16.h>: __half as 16 bits, converted through the compiler's _Float16
// (round to nearest even, as __float2half_rn).
#pragma once

#include <cstdint>
#include <cstring>

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) {
    _Float16 f;
    std::memcpy(&f, &h.bits, sizeof f);
    return static_cast<float>(f);
}

inline __half __float2half_rn(float x) {
    const _Float16 f = static_cast<_Float16>(x);
    __half h;
    std::memcpy(&h.bits, &f, sizeof f);
    return h;
}

// The CPU emulator's stand-in for <cuda_bf16.h>: __nv_bfloat16 as the top 16 bits of an fp32.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t u = static_cast<uint32_t>(h.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    __nv_bfloat16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
        h.bits = 0x7fc0;
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
        h.bits = static_cast<uint16_t>(u >> 16);
    }
    return h;
}

/* IEEE half-precision to float, exactly (every half is a float): for the kernels that read F16 data. */

#ifndef KVLOCAL_HALF_H
#define KVLOCAL_HALF_H

#include <stdint.h>
#include <string.h>

static inline float kvl_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    uint32_t       exp  = (h >> 10) & 0x1fu;
    uint32_t       man  = h & 0x3ffu;
    uint32_t       bits;
    if (exp == 0x1fu) {  // inf, nan
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {  // normal
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {  // zero
        bits = sign;
    } else {  // subnormal: normalise
        exp = 113u;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif

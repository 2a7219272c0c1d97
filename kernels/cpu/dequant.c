/* Quantized KV cache rows to float32: ggml's block formats of the cache types kvlocal rewrites.
 *
 * Scoring a quantized cache reads every cell of every layer at every event; gguf-py's dequantizers are
 * numpy chains over the blocks (several passes, temporaries). One pass here. Each value is computed as
 * gguf-py (and ggml's to_float) computes it — the f16 scale widened to float, one multiply (and one add
 * for the _1 types) in float32, never fused — so the bits match (tests/kernels/test_kernels.py). */

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "kvlocal_kernels.h"

#include <stdint.h>
#include <string.h>

#include "half.h"

static float f16(const uint8_t * p) {  // little-endian IEEE half at p
    return kvl_half_to_float((uint16_t) (p[0] | (p[1] << 8)));
}

/* one block of 32 values: q8_0 34 bytes, q4_0 18, q4_1 20, q5_0 22, q5_1 24 (ggml-common.h) */
static void block_q8_0(const uint8_t * b, float * y) {
    const float d = f16(b);
    for (int j = 0; j < 32; j++) {
        y[j] = d * (float) (int8_t) b[2 + j];
    }
}

static void block_q4_0(const uint8_t * b, float * y) {
    const float d = f16(b);
    for (int j = 0; j < 16; j++) {
        y[j]      = d * (float) ((b[2 + j] & 0x0f) - 8);
        y[j + 16] = d * (float) ((b[2 + j] >> 4) - 8);
    }
}

static void block_q4_1(const uint8_t * b, float * y) {
    const float d = f16(b);
    const float m = f16(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j]      = d * (float) (b[4 + j] & 0x0f) + m;
        y[j + 16] = d * (float) (b[4 + j] >> 4) + m;
    }
}

static void block_q5(const uint8_t * b, float * y, int with_min) {
    const float    d  = f16(b);
    const float    m  = with_min ? f16(b + 2) : 0.0f;
    const uint8_t * p = b + (with_min ? 4 : 2);
    uint32_t       qh;
    memcpy(&qh, p, 4);  // little-endian hosts (x86-64, arm64)
    const uint8_t * qs = p + 4;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 0x0f) | (int) (((qh >> j) & 1u) << 4);
        const int hi = (qs[j] >> 4) | (int) (((qh >> (j + 16)) & 1u) << 4);
        if (with_min) {
            y[j]      = d * (float) lo + m;
            y[j + 16] = d * (float) hi + m;
        } else {
            y[j]      = d * (float) (lo - 16);
            y[j + 16] = d * (float) (hi - 16);
        }
    }
}

int kvl_dequant_rows(int type, const unsigned char * src, long long n_blocks, float * dst) {
    int size;
    switch (type) {
        case 8: size = 34; break;  // GGML_TYPE_Q8_0
        case 2: size = 18; break;  // Q4_0
        case 3: size = 20; break;  // Q4_1
        case 6: size = 22; break;  // Q5_0
        case 7: size = 24; break;  // Q5_1
        default: return -1;
    }
    for (long long i = 0; i < n_blocks; i++) {
        const uint8_t * b = src + i * size;
        float         * y = dst + i * 32;
        switch (type) {
            case 8: block_q8_0(b, y); break;
            case 2: block_q4_0(b, y); break;
            case 3: block_q4_1(b, y); break;
            case 6: block_q5(b, y, 0); break;
            default: block_q5(b, y, 1); break;
        }
    }
    return 0;
}

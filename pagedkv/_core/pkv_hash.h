/* Fast non-cryptographic 64-bit hashing for prefix-cache block keys.
 *
 * The mixing step folds a 64x64->128-bit product to 64 bits (the "multiply-fold"
 * construction of the wyhash/xxh3 family). Each 16-byte lane costs one multiply, so a
 * 16-token block (64 bytes) is 4 multiplies plus a 2-multiply finish.
 *
 * A hash only finds candidates: the prefix index compares the stored tokens before any
 * reuse, so a collision can cost a cache miss but never wrong KV.
 */
#ifndef PAGEDKV_PKV_HASH_H
#define PAGEDKV_PKV_HASH_H

#include <stdint.h>
#include <string.h>

#define PKV_K0 0x91d93080f9b439fdULL
#define PKV_K1 0x2330fcf1562ae4b9ULL
#define PKV_K2 0x952c466e473a1797ULL
#define PKV_K3 0x4c1e26038dabf68fULL
#define PKV_K4 0x521b55ada989d8e5ULL

static inline uint64_t pkv_fold(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * (__uint128_t)b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static inline uint64_t pkv_read64(const unsigned char* p) {
    uint64_t v;
    memcpy(&v, p, 8); /* unaligned-safe; compiles to one load */
    return v;
}

static inline uint64_t pkv_read_tail(const unsigned char* p, size_t n) {
    /* n in [1, 8) */
    uint64_t v = 0;
    memcpy(&v, p, n);
    return v;
}

/* Hash `len` bytes with a 64-bit seed. */
static inline uint64_t pkv_hash_bytes(const void* data, size_t len, uint64_t seed) {
    const unsigned char* p = (const unsigned char*)data;
    uint64_t h = seed ^ pkv_fold(seed ^ PKV_K0, (uint64_t)len ^ PKV_K1);
    size_t i = len;
    while (i >= 16) {
        h = pkv_fold(pkv_read64(p) ^ PKV_K1, pkv_read64(p + 8) ^ h);
        p += 16;
        i -= 16;
    }
    if (i >= 8) {
        uint64_t a = pkv_read64(p);
        uint64_t b = (i > 8) ? pkv_read_tail(p + 8, i - 8) : 0;
        h = pkv_fold(a ^ PKV_K2, b ^ h ^ PKV_K3);
    } else if (i > 0) {
        h = pkv_fold(pkv_read_tail(p, i) ^ PKV_K2, h ^ PKV_K3);
    }
    return pkv_fold(h ^ PKV_K4, (uint64_t)len ^ PKV_K0 ^ seed);
}

/* Chained block hash: the parent's hash and the namespace seed every block, so equal
 * tokens under a different prefix or namespace hash differently. */
static inline uint64_t pkv_hash_block(const int32_t* tokens, int32_t ntokens,
                                      uint64_t parent, uint64_t ns_hash) {
    return pkv_hash_bytes(tokens, (size_t)ntokens * sizeof(int32_t),
                          parent ^ pkv_fold(ns_hash ^ PKV_K3, PKV_K2));
}

/* A deliberately weak hash (four values) used only by tests to force collisions. */
static inline uint64_t pkv_hash_block_weak(const int32_t* tokens, int32_t ntokens,
                                           uint64_t parent, uint64_t ns_hash) {
    uint64_t s = parent + ns_hash;
    for (int32_t i = 0; i < ntokens; i++) s += (uint64_t)(uint32_t)tokens[i];
    return s & 3ULL;
}

#endif

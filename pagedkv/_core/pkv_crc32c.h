/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of iSCSI, ext4
 * and RocksDB: the SSE4.2 crc32 instruction where the CPU has it (several GB/s, three
 * independent streams combined), else slicing-by-8 tables. Both give the same value. */
#ifndef PKV_CRC32C_H
#define PKV_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PKV_CRC32C_POLY 0x82F63B78u

static uint32_t pkv_crc32c_table[8][256];

static void pkv_crc32c_init_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ PKV_CRC32C_POLY : c >> 1;
        pkv_crc32c_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = pkv_crc32c_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = pkv_crc32c_table[0][c & 0xff] ^ (c >> 8);
            pkv_crc32c_table[k][n] = c;
        }
    }
}

/* The running CRC's raw register (already inverted) over n bytes. */
static uint32_t pkv_crc32c_sw(uint32_t crc, const unsigned char* p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { crc = pkv_crc32c_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8); n--; }
    while (n >= 8) {
        /* bytes, not a word load: the same on either byte order */
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = pkv_crc32c_table[7][lo & 0xff] ^ pkv_crc32c_table[6][(lo >> 8) & 0xff] ^
              pkv_crc32c_table[5][(lo >> 16) & 0xff] ^ pkv_crc32c_table[4][lo >> 24] ^
              pkv_crc32c_table[3][hi & 0xff] ^ pkv_crc32c_table[2][(hi >> 8) & 0xff] ^
              pkv_crc32c_table[1][(hi >> 16) & 0xff] ^ pkv_crc32c_table[0][hi >> 24];
        p += 8; n -= 8;
    }
    while (n) { crc = pkv_crc32c_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8); n--; }
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PKV_CRC32C_HW 1
#include <nmmintrin.h>

/* Multiply-free shift of a raw CRC register by n zero bytes (to combine streams). */
static uint32_t pkv_crc32c_shift(uint32_t crc, size_t n) {
    /* x^(8n) mod P applied by squaring: the GF(2) matrix method of zlib's crc32_combine */
    uint32_t odd[32], even[32], row = 1;
    odd[0] = PKV_CRC32C_POLY;
    for (int i = 1; i < 32; i++) { odd[i] = row; row <<= 1; }
#define PKV_GF2_TIMES(mat, vec, out) do { uint32_t v_ = (vec), s_ = 0; const uint32_t* m_ = (mat); \
        while (v_) { if (v_ & 1) s_ ^= *m_; v_ >>= 1; m_++; } (out) = s_; } while (0)
#define PKV_GF2_SQUARE(sq, mat) do { for (int j_ = 0; j_ < 32; j_++) PKV_GF2_TIMES((mat), (mat)[j_], (sq)[j_]); } while (0)
    PKV_GF2_SQUARE(even, odd);      /* 2 zero bits */
    PKV_GF2_SQUARE(odd, even);      /* 4 zero bits */
    do {
        PKV_GF2_SQUARE(even, odd);
        if (n & 1) PKV_GF2_TIMES(even, crc, crc);
        n >>= 1;
        if (!n) break;
        PKV_GF2_SQUARE(odd, even);
        if (n & 1) PKV_GF2_TIMES(odd, crc, crc);
        n >>= 1;
    } while (n);
#undef PKV_GF2_TIMES
#undef PKV_GF2_SQUARE
    return crc;
}

#define PKV_CRC32C_LANE 8192
static uint32_t pkv_crc32c_lane_op[32];     /* shift by one lane of zero bytes, as a GF(2) matrix */

static uint32_t pkv_crc32c_shift_lane(uint32_t crc) {
    uint32_t s = 0;
    for (int i = 0; crc; i++, crc >>= 1)
        if (crc & 1) s ^= pkv_crc32c_lane_op[i];
    return s;
}

__attribute__((target("sse4.2")))
static uint32_t pkv_crc32c_hw(uint32_t crc, const unsigned char* p, size_t n) {
    uint64_t c0 = crc;
    while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    /* three streams hide the instruction's latency; joined by shifting the CRCs */
    const size_t lane = PKV_CRC32C_LANE;
    while (n >= 3 * lane) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char* a = p;
        const unsigned char* b = p + lane;
        const unsigned char* d = p + 2 * lane;
        for (size_t i = 0; i < lane; i += 8) {
            uint64_t x, y, z;
            memcpy(&x, a + i, 8); memcpy(&y, b + i, 8); memcpy(&z, d + i, 8);
            c0 = _mm_crc32_u64(c0, x); c1 = _mm_crc32_u64(c1, y); c2 = _mm_crc32_u64(c2, z);
        }
        uint32_t r = pkv_crc32c_shift_lane((uint32_t)c0) ^ (uint32_t)c1;
        r = pkv_crc32c_shift_lane(r) ^ (uint32_t)c2;
        c0 = r;
        p += 3 * lane; n -= 3 * lane;
    }
    while (n >= 8) { uint64_t v; memcpy(&v, p, 8); c0 = _mm_crc32_u64(c0, v); p += 8; n -= 8; }
    while (n) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    return (uint32_t)c0;
}

static int pkv_crc32c_hw_ok = 0;
#endif

/* Once, before any call (the module's import): the tables and the CPU check. */
static void pkv_crc32c_init(void) {
    pkv_crc32c_init_table();
#ifdef PKV_CRC32C_HW
    for (int i = 0; i < 32; i++) pkv_crc32c_lane_op[i] = pkv_crc32c_shift(1u << i, PKV_CRC32C_LANE);
    pkv_crc32c_hw_ok = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
}

/* CRC-32C of n bytes continuing ``crc`` (0 to start; the value a previous call returned). */
static uint32_t pkv_crc32c(uint32_t crc, const unsigned char* p, size_t n, int portable) {
    uint32_t r = ~crc;
#ifdef PKV_CRC32C_HW
    if (!portable && pkv_crc32c_hw_ok) return ~pkv_crc32c_hw(r, p, n);
#endif
    return ~pkv_crc32c_sw(r, p, n);
}

static int pkv_crc32c_hardware(void) {
#ifdef PKV_CRC32C_HW
    return pkv_crc32c_hw_ok;
#else
    return 0;
#endif
}

#endif

// The one SIMD header of pystronghold: a float vector `simd::vf` of `simd::kWidth` lanes with the
// few operations the host kernels need (fp32 arithmetic without implicit FMA, bf16/fp16 loads and
// round-to-nearest-even stores, a non-finite detector). One implementation per ISA: AVX-512,
// AVX2+FMA+F16C, NEON, or scalar.
//
// Included only by the variant sources csrc/simd_<isa>.cpp, each of which defines the macro of its
// ISA (PYSTRONGHOLD_SIMD_AVX512, _AVX2, _NEON or _SCALAR) and is compiled with the baseline flags of
// the whole library. Everything between PYSTRONGHOLD_SIMD_BEGIN and PYSTRONGHOLD_SIMD_END is
// compiled for that ISA (a target pragma) and lives in the inline namespace PYSTRONGHOLD_SIMD_NS,
// so the variants' functions never share a symbol. The standard headers are included before the
// region: their inline functions keep the baseline ISA.
//
// The scalar functions at the bottom are the tails of every kernel and the reference the vector
// paths must match bit for bit (tests check the vector and tail paths against torch).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(PYSTRONGHOLD_SIMD_AVX512) || defined(PYSTRONGHOLD_SIMD_AVX2)
// NOTE: GCC 12's AVX-512 intrinsics read an undefined register on purpose (_mm512_undefined_*),
// which -Wmaybe-uninitialized reports at their lines in avx512fintrin.h once they are inlined into
// our kernels (~190 warnings). Silenced for the lines of that header only: ours keep the warning.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#if defined(PYSTRONGHOLD_SIMD_AVX512)
#define PYSTRONGHOLD_SIMD_NS avx512
#define PYSTRONGHOLD_SIMD_ISA "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#else
#define PYSTRONGHOLD_SIMD_NS avx2
#define PYSTRONGHOLD_SIMD_ISA "avx2,fma,f16c"
#endif
// NOTE: two levels, so PYSTRONGHOLD_SIMD_ISA expands (to a string literal) before it is stringified.
#define PYSTRONGHOLD_SIMD_STR(x) #x
#define PYSTRONGHOLD_SIMD_PRAGMA(x) _Pragma(PYSTRONGHOLD_SIMD_STR(x))
#if defined(__clang__)
#define PYSTRONGHOLD_SIMD_BEGIN \
  PYSTRONGHOLD_SIMD_PRAGMA(clang attribute push(__attribute__((target(PYSTRONGHOLD_SIMD_ISA))), apply_to = function))
#define PYSTRONGHOLD_SIMD_END _Pragma("clang attribute pop")
#else
#define PYSTRONGHOLD_SIMD_BEGIN _Pragma("GCC push_options") PYSTRONGHOLD_SIMD_PRAGMA(GCC target(PYSTRONGHOLD_SIMD_ISA))
#define PYSTRONGHOLD_SIMD_END _Pragma("GCC pop_options")
#endif
#elif defined(PYSTRONGHOLD_SIMD_NEON)
#if !defined(__aarch64__)
#error "PYSTRONGHOLD_SIMD_NEON: NEON variant needs aarch64 (it is baseline there)"
#endif
#include <arm_neon.h>
#define PYSTRONGHOLD_SIMD_NS neon
#define PYSTRONGHOLD_SIMD_BEGIN
#define PYSTRONGHOLD_SIMD_END
#elif defined(PYSTRONGHOLD_SIMD_SCALAR)
#define PYSTRONGHOLD_SIMD_NS scalar
#define PYSTRONGHOLD_SIMD_BEGIN
#define PYSTRONGHOLD_SIMD_END
#else
#error "simd.h: include it from a variant source (csrc/simd_<isa>.cpp) that defines its ISA macro"
#endif

PYSTRONGHOLD_SIMD_BEGIN
namespace pystronghold {
namespace simd {
inline namespace PYSTRONGHOLD_SIMD_NS {

// ---- scalar helpers (tails and reference)

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (quiet NaN), as c10::BFloat16 does.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u = float_to_bits(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 <-> binary32 (round to nearest even), without relying on F16C for the tail.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    const float mag = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -mag : mag;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t au = u & 0x7FFFFFFFu;
  if (au >= 0x7F800000u) {  // inf or NaN (NaN keeps the top payload bits and stays quiet)
    return au == 0x7F800000u ? (sign | 0x7C00u) : (sign | 0x7E00u | static_cast<uint16_t>((au >> 13) & 0x3FFu));
  }
  if (au >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: overflow to inf
  if (au < 0x38800000u) {                         // below the smallest normal half: subnormal or 0
    // f = m * 2^-24 with m possibly fractional: round m to the nearest even integer.
    const float m = bits_to_float(au) * 16777216.0f;  // exact scaling by 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(m));  // default rounding mode: to even
  }
  uint32_t r = au - 0x38000000u;           // rebias exponent (127 -> 15), keep 23-bit mantissa
  r += 0x0FFFu + ((r >> 13) & 1u);          // round to nearest even on the 13 dropped bits
  return sign | static_cast<uint16_t>(r >> 13);
}

// ---- vector implementations

#if defined(PYSTRONGHOLD_SIMD_AVX512)
constexpr int kWidth = 16;
constexpr const char* kName = "avx512";
using vf = __m512;
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf load_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vf load_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// bf16 (round to nearest even, NaN -> quiet NaN) and fp16 packing of kWidth floats: the one rounding
// behind both the plain and the non-temporal stores.
inline __m256i pack_bf16(vf x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline __m256i pack_half(vf x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store_u16(uint16_t* p, __m256i packed) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed); }
inline void store_bf16(uint16_t* p, vf x) { store_u16(p, pack_bf16(x)); }
inline void store_half(uint16_t* p, vf x) { store_u16(p, pack_half(x)); }
// Non-temporal store of kWidth 16-bit values (p aligned to kWidth * 2 bytes), written around the
// cache (no read for ownership of a write-only line).
inline void stream_u16(uint16_t* p, __m256i packed) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed); }
inline void stream_bf16(uint16_t* p, vf x) { stream_u16(p, pack_bf16(x)); }
inline void stream_half(uint16_t* p, vf x) { stream_u16(p, pack_half(x)); }
inline void stream_fence() { _mm_sfence(); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf sqrt(vf a) { return _mm512_sqrt_ps(a); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a*b+c, one rounding
// True when every lane of `acc` is finite; `acc` accumulates (x - x), which is NaN iff x is not finite.
inline bool all_finite(vf acc) { return _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) == 0; }

#elif defined(PYSTRONGHOLD_SIMD_AVX2)
constexpr int kWidth = 8;
constexpr const char* kName = "avx2";
using vf = __m256;
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf load_bf16(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vf load_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Packing, plain and non-temporal stores (p aligned to kWidth * 2 = 16 bytes): see the AVX-512 block.
inline __m128i pack_bf16(vf x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // every lane is <= 0xFFFF, so unsigned saturation packs exactly; lo/hi halves keep lane order
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline __m128i pack_half(vf x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store_u16(uint16_t* p, __m128i packed) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed); }
inline void store_bf16(uint16_t* p, vf x) { store_u16(p, pack_bf16(x)); }
inline void store_half(uint16_t* p, vf x) { store_u16(p, pack_half(x)); }
inline void stream_u16(uint16_t* p, __m128i packed) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), packed); }
inline void stream_bf16(uint16_t* p, vf x) { stream_u16(p, pack_bf16(x)); }
inline void stream_half(uint16_t* p, vf x) { stream_u16(p, pack_half(x)); }
inline void stream_fence() { _mm_sfence(); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf sqrt(vf a) { return _mm256_sqrt_ps(a); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline bool all_finite(vf acc) { return _mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)) == 0; }

#elif defined(PYSTRONGHOLD_SIMD_NEON)
constexpr int kWidth = 4;
constexpr const char* kName = "neon";
using vf = float32x4_t;
inline vf set1(float x) { return vdupq_n_f32(x); }
inline vf load(const float* p) { return vld1q_f32(p); }
inline void store(float* p, vf x) { vst1q_f32(p, x); }
inline vf load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline vf load_half(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline void store_bf16(uint16_t* p, vf x) {
  uint32x4_t u = vreinterpretq_u32_f32(x);
  uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
  uint32x4_t ordered = vceqq_f32(x, x);  // all ones where x is not NaN
  r = vbslq_u32(ordered, r, vdupq_n_u32(0x7FC0));
  vst1_u16(p, vmovn_u32(r));
}
inline void store_half(uint16_t* p, vf x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }
// No non-temporal store in NEON intrinsics: plain stores.
inline void stream_bf16(uint16_t* p, vf x) { store_bf16(p, x); }
inline void stream_half(uint16_t* p, vf x) { store_half(p, x); }
inline void stream_fence() {}
inline vf add(vf a, vf b) { return vaddq_f32(a, b); }
inline vf sub(vf a, vf b) { return vsubq_f32(a, b); }
inline vf mul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf div(vf a, vf b) { return vdivq_f32(a, b); }
inline vf sqrt(vf a) { return vsqrtq_f32(a); }
inline vf fmadd(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline bool all_finite(vf acc) { return vminvq_u32(vceqq_f32(acc, acc)) != 0; }

#else
constexpr int kWidth = 1;
constexpr const char* kName = "scalar";
using vf = float;
inline vf set1(float x) { return x; }
inline vf load(const float* p) { return *p; }
inline void store(float* p, vf x) { *p = x; }
inline vf load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
inline vf load_half(const uint16_t* p) { return half_to_float(*p); }
inline void store_bf16(uint16_t* p, vf x) { *p = float_to_bf16(x); }
inline void store_half(uint16_t* p, vf x) { *p = float_to_half(x); }
inline void stream_bf16(uint16_t* p, vf x) { store_bf16(p, x); }
inline void stream_half(uint16_t* p, vf x) { store_half(p, x); }
inline void stream_fence() {}
inline vf add(vf a, vf b) { return a + b; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf div(vf a, vf b) { return a / b; }
inline vf sqrt(vf a) { return std::sqrt(a); }
inline vf fmadd(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline bool all_finite(vf acc) { return !std::isnan(acc); }
#endif

// ---- typed loads/stores of the element types the kernels accept (tag dispatch on the C++ type)

struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

inline vf load_as_float(const float* p) { return load(p); }
inline vf load_as_float(const BF16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline vf load_as_float(const F16* p) { return load_half(reinterpret_cast<const uint16_t*>(p)); }
inline float scalar_as_float(const float* p) { return *p; }
inline float scalar_as_float(const BF16* p) { return bf16_to_float(p->bits); }
inline float scalar_as_float(const F16* p) { return half_to_float(p->bits); }

inline void store_from_float(BF16* p, vf x) { store_bf16(reinterpret_cast<uint16_t*>(p), x); }
inline void store_from_float(F16* p, vf x) { store_half(reinterpret_cast<uint16_t*>(p), x); }
// Non-temporal: p must be aligned to kWidth * 2 bytes (kStreamAlign).
constexpr int kStreamAlign = kWidth * 2;
inline void stream_from_float(BF16* p, vf x) { stream_bf16(reinterpret_cast<uint16_t*>(p), x); }
inline void stream_from_float(F16* p, vf x) { stream_half(reinterpret_cast<uint16_t*>(p), x); }
inline void scalar_from_float(BF16* p, float x) { p->bits = float_to_bf16(x); }
inline void scalar_from_float(F16* p, float x) { p->bits = float_to_half(x); }

}  // inline namespace PYSTRONGHOLD_SIMD_NS
}  // namespace simd
}  // namespace pystronghold

PYSTRONGHOLD_SIMD_END

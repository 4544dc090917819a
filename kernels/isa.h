/* isa.h: which vector instructions this build uses, and the bf16 storage type.
 *
 * The one place that reads the compiler's ISA macros: simd.h picks its
 * implementation and kernels.h its tile height from ISA_AVX512 / ISA_AVX2. */
#ifndef ISA_H
#define ISA_H

#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define ISA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA_AVX2 1
#endif

/* the upper half of an IEEE fp32: widening is a 16-bit shift */
typedef uint16_t bf16;

#endif /* ISA_H */

/* Batched copies for kvtier's client: one call copies a list of (dst, src, size) runs.
 *
 * Large transfers are written with non-temporal (streaming) stores: a normal store first reads
 * each destination cache line (read for ownership), so a copy far larger than the caches moves
 * its bytes over the memory bus three times; a streaming store skips that read. glibc's memcpy
 * does the same, but only for single copies larger than about 3/4 of the shared cache, never for
 * the page-sized pieces a paged KV cache is made of. Small transfers keep memmove, which leaves
 * the bytes in the cache for whoever reads them next.
 *
 * Loaded with ctypes (no Python headers); built by hatch_build.py at install. The caller
 * (kvtier/client/copying.py) checks nothing here: addresses must be valid for their sizes.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define KVTIER_X86 1
#endif

/* ABI version: kvtier/client/native/__init__.py refuses a library of another one (a stale
 * build). */
int kvtier_copy_abi(void) { return 1; }

#ifdef KVTIER_X86
typedef void (*stream_fn)(char *dst, const char *src, size_t n);

/* dst is 64-byte aligned, n a multiple of 64 */
static void stream_sse2(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}

__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    if (i < n) stream_sse2(dst + i, src + i, n - i);
}

__attribute__((target("avx512f"))) static void stream_avx512(char *dst, const char *src,
                                                              size_t n) {
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m512i a = _mm512_loadu_si512((const void *)(src + i));
        __m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + i + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + i + 192));
        _mm512_stream_si512((void *)(dst + i), a);
        _mm512_stream_si512((void *)(dst + i + 64), b);
        _mm512_stream_si512((void *)(dst + i + 128), c);
        _mm512_stream_si512((void *)(dst + i + 192), d);
    }
    if (i < n) stream_sse2(dst + i, src + i, n - i);
}

static stream_fn pick_stream(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return stream_avx512;
    if (__builtin_cpu_supports("avx2")) return stream_avx2;
    return stream_sse2;
}

/* Name of the streaming variant in use: "avx512", "avx2" or "sse2" ("" off x86). */
const char *kvtier_copy_variant(void) {
    stream_fn f = pick_stream();
    return f == stream_avx512 ? "avx512" : f == stream_avx2 ? "avx2" : "sse2";
}
typedef stream_fn stream_fn_or_null;

static int overlaps(uintptr_t dst, uintptr_t src, size_t n) {
    return dst < src + n && src < dst + n;
}
#else
const char *kvtier_copy_variant(void) { return ""; }
typedef void *stream_fn_or_null;
#endif

static void copy_run(const uint64_t *run, stream_fn_or_null stream, int *streamed);

/* Copy `count` runs, `runs` holding (dst, src, size) triples. `streaming` != 0: runs of at least
 * 4 KiB that do not overlap are written with streaming stores (x86 only; memmove elsewhere), and
 * the call returns after a store fence, so the bytes are visible to other threads.
 *
 * `next` NULL: this call copies every run, in order. Otherwise several threads call this with the
 * same runs and the same `next` (0 at first): each takes the next run not taken yet until none
 * is left, so a thread that gets less of the CPU simply copies fewer runs. */
void kvtier_copy_runs(const uint64_t *runs, size_t count, int streaming, size_t *next) {
    stream_fn_or_null stream = NULL;
    int streamed = 0;
#ifdef KVTIER_X86
    if (streaming) stream = pick_stream();
#else
    (void)streaming;
#endif
    if (next == NULL) {
        for (size_t k = 0; k < count; k++) copy_run(runs + 3 * k, stream, &streamed);
    } else {
        for (;;) {
            size_t k = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
            if (k >= count) break;
            copy_run(runs + 3 * k, stream, &streamed);
        }
    }
#ifdef KVTIER_X86
    if (streamed) _mm_sfence();
#endif
}

static void copy_run(const uint64_t *run, stream_fn_or_null stream, int *streamed) {
    char *dst = (char *)(uintptr_t)run[0];
    const char *src = (const char *)(uintptr_t)run[1];
    size_t n = (size_t)run[2];
#ifdef KVTIER_X86
    if (stream != NULL && n >= 4096 && !overlaps((uintptr_t)dst, (uintptr_t)src, n)) {
        size_t head = (size_t)(-(uintptr_t)dst & 63);
        size_t body = (n - head) & ~(size_t)63;
        memcpy(dst, src, head);
        stream(dst + head, src + head, body);
        memcpy(dst + head + body, src + head + body, n - head - body);
        *streamed = 1;
        return;
    }
#else
    (void)stream;
    (void)streamed;
#endif
    memmove(dst, src, n);
}

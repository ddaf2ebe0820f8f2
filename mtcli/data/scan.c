/* One pass over a block of text lines for cleaning (mtcli/data/scan.py): where each line
 * ends, how many words it holds by Python's str.split(), and the 64-bit hash of its bytes
 * that pandas' hash_array gives it (SipHash-2-4 under pandas' fixed key, then a 64-bit
 * mixer), while checking the block is UTF-8 by Python's strict rules. */

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Byte classes: a word byte, a one-byte space, the line end, '\r', the lead byte of a
 * character that may be a wide space (0xC2, 0xE1-0xE3), any other byte >= 0x80. */
enum { WORD = 0, SPACE = 1, NEWLINE = 2, CR = 3, LEAD = 4, HIGH = 5 };

static uint8_t byte_class[256];
static int classes_ready = 0;

static void make_classes(void) {
    for (int c = 0; c < 256; c++) {
        uint8_t k = WORD;
        if (c == '\n') k = NEWLINE;
        else if (c == '\r') k = CR;
        else if (c == ' ' || (c >= 9 && c <= 12) || (c >= 28 && c <= 31)) k = SPACE;
        else if (c == 0xC2 || (c >= 0xE1 && c <= 0xE3)) k = LEAD;
        else if (c >= 0x80) k = HIGH;
        byte_class[c] = k;
    }
    classes_ready = 1;
}

/* The length of the valid UTF-8 character at s[0] (a byte >= 0x80; `left` bytes remain),
 * or 0 where Python's strict decoder would stop there. */
static int utf8_length(const uint8_t *s, long left) {
    uint8_t c = s[0];
    if (c >= 0xC2 && c <= 0xDF) {
        return left >= 2 && (s[1] & 0xC0) == 0x80 ? 2 : 0;
    }
    if (c >= 0xE0 && c <= 0xEF) {
        if (left < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && s[1] < 0xA0) return 0;  /* overlong */
        if (c == 0xED && s[1] > 0x9F) return 0;  /* a surrogate */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (left < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80) return 0;
        if (c == 0xF0 && s[1] < 0x90) return 0;  /* overlong */
        if (c == 0xF4 && s[1] > 0x8F) return 0;  /* above U+10FFFF */
        return 4;
    }
    return 0;
}

/* Whether the n-byte character at s is one of the spaces above U+007F that str.split()
 * splits on: U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000. */
static int wide_space(const uint8_t *s, int n) {
    if (n == 2) return s[0] == 0xC2 && (s[1] == 0x85 || s[1] == 0xA0);
    if (n != 3) return 0;
    if (s[0] == 0xE1) return s[1] == 0x9A && s[2] == 0x80;
    if (s[0] == 0xE3) return s[1] == 0x80 && s[2] == 0x80;
    if (s[0] != 0xE2) return 0;
    if (s[1] == 0x80) return s[2] <= 0x8A || s[2] == 0xA8 || s[2] == 0xA9 || s[2] == 0xAF;
    return s[1] == 0x81 && s[2] == 0x9F;
}

/* ------------------------------------------------------------------ pandas' hash of bytes */

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                          \
    do {                                                                  \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);         \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                            \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                            \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);         \
    } while (0)

/* SipHash-2-4 of s[0:n] under the key "0123456789123456" (pandas' hash_object_array), then
 * the mixer pandas' hash_array applies to every value. */
static uint64_t line_hash(const uint8_t *s, long n) {
    const uint64_t k0 = 0x3736353433323130ULL, k1 = 0x3635343332313938ULL;
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
    long whole = n - (n % 8);
    for (long i = 0; i < whole; i += 8) {
        uint64_t m;
        memcpy(&m, s + i, 8);  /* little-endian machines only (x86-64, arm64) */
        v3 ^= m;
        SIPROUND; SIPROUND;
        v0 ^= m;
    }
    uint64_t b = (uint64_t)n << 56;
    for (long i = n - 1; i >= whole; i--) b |= (uint64_t)s[i] << (8 * (i - whole));
    v3 ^= b;
    SIPROUND; SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    uint64_t h = v0 ^ v1 ^ v2 ^ v3;
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBULL;
    h ^= h >> 31;
    return h;
}

/* ------------------------------------------------------------------ the scan */

/* Where a scan stands: the line being read starts at `start` and holds `count` words so far;
 * `after_space` when the last byte read was a space (or the line has just begun). */
struct scan {
    const uint8_t *s;
    long n, lines, capacity, start, count;
    int after_space;
    int64_t *stops, *words;
    uint64_t *hashes;
};

/* End the line at s[at] ('\n', or the block's end); 0, or -3 past the capacity. */
static int end_line(struct scan *t, long at, long stop) {
    if (t->lines == t->capacity) return -3;
    t->stops[t->lines] = stop;
    t->words[t->lines] = t->count;
    if (t->hashes) t->hashes[t->lines] = line_hash(t->s + t->start, at - t->start);
    t->lines++;
    t->start = stop;
    t->count = 0;
    t->after_space = 1;
    return 0;
}

/* Scan bytes [i, stop) one character at a time; returns where it stopped (>= stop, a
 * character may run past it) or a negative code (see scan_lines). */
static long scan_bytes(struct scan *t, long i, long stop, int strict) {
    const uint8_t *s = t->s;
    while (i < stop) {
        uint8_t k = byte_class[s[i]];
        if (k <= SPACE) {
            t->count += (k == WORD) & t->after_space;
            t->after_space = k;
            i++;
        } else if (k == NEWLINE) {
            if (end_line(t, i, i + 1)) return -3;
            i++;
        } else if (k == CR) {
            if (strict) return -2;
            t->after_space = 1;
            i++;
        } else {
            int len = utf8_length(s + i, t->n - i);
            if (len == 0) return -1;
            int space = k == LEAD && wide_space(s + i, len);
            t->count += (!space) & t->after_space;
            t->after_space = space;
            i += len;
        }
    }
    return i;
}

#ifdef __AVX2__
/* Masks of the 64 bytes at s: bytes >= 0x80, '\n', '\r', and spaces (ASCII ones, '\n' and
 * '\r' included). */
static inline void masks64(const uint8_t *s, uint64_t *high, uint64_t *nl, uint64_t *cr, uint64_t *sp) {
    uint64_t m[4] = {0, 0, 0, 0};
    for (int half = 0; half < 2; half++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(s + 32 * half));
        __m256i tab = _mm256_and_si256(_mm256_cmpgt_epi8(v, _mm256_set1_epi8(8)),
                                       _mm256_cmpgt_epi8(_mm256_set1_epi8(14), v));   /* 9-13 */
        __m256i sep = _mm256_and_si256(_mm256_cmpgt_epi8(v, _mm256_set1_epi8(27)),
                                       _mm256_cmpgt_epi8(_mm256_set1_epi8(33), v));   /* 28-32 */
        __m256i space = _mm256_or_si256(tab, sep);
        m[0] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(v) << (32 * half);
        m[1] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8('\n'))) << (32 * half);
        m[2] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8('\r'))) << (32 * half);
        m[3] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(space) << (32 * half);
    }
    *high = m[0]; *nl = m[1]; *cr = m[2]; *sp = m[3];
}

/* The bits first..last (inclusive; last < 64) of a 64-bit mask. */
static inline uint64_t bit_range(int first, int last) {
    return (~0ULL >> (63 - last)) & (~0ULL << first);
}

/* Scan the 64 bytes at s[i] at once. Word starts are the bytes that are not spaces after
 * one that is, and each '\n' ends a line with the word starts before it. A byte >= 0x80 is
 * part of a word unless its character is a wide space; each such character is checked as
 * UTF-8 on its own. `*carry` is how many bytes at s[i] continue a character begun before
 * them, and 64 + that many when that character is a space; it is updated for the next 64
 * bytes. Returns 0, or a negative code (see scan_lines). */
static int scan64(struct scan *t, long i, int strict, int *carry) {
    uint64_t high, nl, cr, sp;
    masks64(t->s + i, &high, &nl, &cr, &sp);
    if (strict && cr) return -2;
    int cont = *carry & 63;
    if (cont) {
        uint64_t first = bit_range(0, cont - 1);
        high &= ~first;
        if (*carry & 64) sp |= first;
    }
    *carry = 0;
    while (high) {
        int p = __builtin_ctzll(high);
        int len = utf8_length(t->s + i + p, t->n - i - p);
        if (len == 0) return -1;
        int last = p + len - 1 < 63 ? p + len - 1 : 63;
        int space = byte_class[t->s[i + p]] == LEAD && wide_space(t->s + i + p, len);
        if (space) sp |= bit_range(p, last);
        if (p + len > 64) *carry = (p + len - 64) | (space ? 64 : 0);
        high &= ~bit_range(p, last);
    }
    uint64_t starts = ~sp & ((sp << 1) | (uint64_t)t->after_space);
    while (nl) {
        int p = __builtin_ctzll(nl);
        uint64_t before = p ? starts & (~0ULL >> (64 - p)) : 0;
        t->count += __builtin_popcountll(before);
        starts &= ~before;
        if (end_line(t, i + p, i + p + 1)) return -3;
        nl &= nl - 1;
    }
    t->count += __builtin_popcountll(starts);
    t->after_space = (int)(sp >> 63);
    return 0;
}
#endif

/* Scan s[0:n], lines ended by '\n' (the last may have none). For line i: stops[i] is the
 * offset just after it (its '\n' included), words[i] its word count, and hashes[i] (when
 * hashes is not NULL) the hash of its bytes without the '\n'. Returns the number of lines, or
 *   -1  invalid UTF-8 somewhere (the caller's decoder names where),
 *   -2  a '\r', or (with file_start) a UTF-8 byte-order mark first: bytes the reader would
 *       change, so the caller decodes them line by line (only with strict),
 *   -3  more than `capacity` lines.
 * Without `strict`, '\r' is a space as str.split() has it. Where the CPU has AVX2, the
 * bytes are read 64 at a time (scan64), the few at the end one character at a time. */
long scan_lines(const uint8_t *s, long n, int strict, int file_start, long capacity,
                int64_t *stops, int64_t *words, uint64_t *hashes) {
    if (!classes_ready) make_classes();
    if (strict && file_start && n >= 3 && s[0] == 0xEF && s[1] == 0xBB && s[2] == 0xBF) return -2;
    struct scan t = {s, n, 0, capacity, 0, 0, 1, stops, words, hashes};
    long i = 0;
#ifdef __AVX2__
    int carry = 0;
    for (; i + 64 <= n; i += 64) {
        int code = scan64(&t, i, strict, &carry);
        if (code < 0) return code;
    }
    i += carry & 63;  /* the rest of a character begun in the last 64 bytes, checked there */
#endif
    i = scan_bytes(&t, i, n, strict);
    if (i < 0) return i;
    if (t.start < n && end_line(&t, n, n)) return -3;  /* a last line without '\n' */
    return t.lines;
}

/* The number of '\n' bytes in s[0:n]; where `every` > 0, also the offsets just after every
 * `every`-th of them, counting on from `seen` line ends before s, into cuts[0..room) (the
 * caller gives room for n / every + 1), their number in *found. */
long line_cuts(const uint8_t *s, long n, long every, long seen, int64_t *cuts, long room,
               long *found) {
    long count = 0, k = 0, i = 0;
    long left = every > 0 ? every - seen % every : -1; /* line ends until the next cut */
#ifdef __AVX2__
    const __m256i newline = _mm256_set1_epi8('\n');
    for (; i + 32 <= n; i += 32) {
        uint32_t bits = (uint32_t)_mm256_movemask_epi8(
            _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(s + i)), newline));
        long ends = __builtin_popcount(bits);
        count += ends;
        if (left < 0 || ends < left) {
            left -= left < 0 ? 0 : ends;
            continue;
        }
        for (; bits; bits &= bits - 1) { /* a cut falls in these 32 bytes: walk their ends */
            if (--left == 0) {
                if (k < room) cuts[k++] = i + __builtin_ctz(bits) + 1;
                left = every;
            }
        }
    }
#endif
    for (; i < n; i++) {
        if (s[i] != '\n') continue;
        count++;
        if (left > 0 && --left == 0) {
            if (k < room) cuts[k++] = i + 1;
            left = every;
        }
    }
    if (found) *found = k;
    return count;
}

/* Copies the spans s[starts[i]:ends[i]], i < k, one after another to out; returns the bytes
 * written. */
long take_spans(const uint8_t *s, const int64_t *starts, const int64_t *ends, long k, uint8_t *out) {
    long at = 0;
    for (long i = 0; i < k; i++) {
        memcpy(out + at, s + starts[i], (size_t)(ends[i] - starts[i]));
        at += ends[i] - starts[i];
    }
    return at;
}

/* The number of '\n' bytes in s[0:n]. */
long count_lines(const uint8_t *s, long n) {
    return line_cuts(s, n, 0, 0, 0, 0, 0);
}

/* Rows of an Arrow string column as lines: row i (data[offsets[i] - offsets[0]] up to
 * offsets[i + 1]) copied to out, then '\n'. Returns the bytes written, or -1 where a row holds
 * a '\n' or '\r' (the caller replaces those first). out holds the data's bytes plus `rows`. */
long join_rows(const uint8_t *data, const int64_t *offsets, long rows, uint8_t *out) {
    long size = offsets[rows] - offsets[0];
    int breaks = 0;
    for (long i = 0; i < size; i++) breaks |= (data[i] == '\n') | (data[i] == '\r');
    if (breaks) return -1;
    uint8_t *at = out;
    for (long i = 0; i < rows; i++) {
        long length = offsets[i + 1] - offsets[i];
        memcpy(at, data + (offsets[i] - offsets[0]), (size_t)length);
        at += length;
        *at++ = '\n';
    }
    return at - out;
}

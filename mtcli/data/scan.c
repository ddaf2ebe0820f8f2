/* One pass over a block of text lines for cleaning (mtcli/data/scan.py): where each line
 * ends, how many words it holds by Python's str.split(), and the 64-bit hash of its bytes
 * that pandas' hash_array gives it (SipHash-2-4 under pandas' fixed key, then a 64-bit
 * mixer), while checking the block is UTF-8 by Python's strict rules. */

#include <stdint.h>
#include <string.h>

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

/* Scan s[0:n], lines ended by '\n' (the last may have none). For line i: stops[i] is the
 * offset just after it (its '\n' included), words[i] its word count, and hashes[i] (when
 * hashes is not NULL) the hash of its bytes without the '\n'. Returns the number of lines, or
 *   -1  invalid UTF-8 somewhere (the caller's decoder names where),
 *   -2  a '\r', or (with file_start) a UTF-8 byte-order mark first: bytes the reader would
 *       change, so the caller decodes them line by line (only with strict),
 *   -3  more than `capacity` lines.
 * Without `strict`, '\r' is a space as str.split() has it. */
long scan_lines(const uint8_t *s, long n, int strict, int file_start, long capacity,
                int64_t *stops, int64_t *words, uint64_t *hashes) {
    if (!classes_ready) make_classes();
    if (strict && file_start && n >= 3 && s[0] == 0xEF && s[1] == 0xBB && s[2] == 0xBF) return -2;
    long lines = 0, start = 0, count = 0;
    int after_space = 1;
    long i = 0;
    while (i < n) {
        uint8_t k = byte_class[s[i]];
        if (k <= SPACE) {
            count += (k == WORD) & after_space;
            after_space = k;
            i++;
            continue;
        }
        if (k == NEWLINE || k == CR) {
            if (k == CR) {
                if (strict) return -2;
                after_space = 1;
                i++;
                continue;
            }
            if (lines == capacity) return -3;
            stops[lines] = i + 1;
            words[lines] = count;
            if (hashes) hashes[lines] = line_hash(s + start, i - start);
            lines++;
            start = ++i;
            count = 0;
            after_space = 1;
            continue;
        }
        int len = utf8_length(s + i, n - i);
        if (len == 0) return -1;
        int space = k == LEAD && wide_space(s + i, len);
        count += !space & after_space;
        after_space = space;
        i += len;
    }
    if (start < n) {  /* a last line without '\n' */
        if (lines == capacity) return -3;
        stops[lines] = n;
        words[lines] = count;
        if (hashes) hashes[lines] = line_hash(s + start, n - start);
        lines++;
    }
    return lines;
}

/* The number of '\n' bytes in s[0:n]. */
long count_lines(const uint8_t *s, long n) {
    long count = 0;
    for (long i = 0; i < n; i++) count += s[i] == '\n';
    return count;
}

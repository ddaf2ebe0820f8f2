/* A table of words and their SentencePiece ids, for encoding text a word at a time
 * (mtcli/data/wordtable.py). A word is what lies before a ' ' or a '\n'; its key is its bytes
 * without that end. Encoding a block of lines is three calls: wt_scan finds every word's entry
 * and adds an entry without ids for each word the table does not know (each once); the caller
 * encodes those with SentencePiece and gives their ids to wt_set_ids; wt_emit writes every
 * word's ids and each line's count. wt_end_block then drops the entries past max_words, so the
 * table keeps the first max_words distinct words it met. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* A word: its key in keys, its ids in ids (ids_len -1 until given), its hash; 32 bytes, so a
 * lookup touches one line of them. */
typedef struct {
    uint64_t hash;
    int64_t key_at, ids_at;
    int32_t key_len, ids_len;
} entry;

typedef struct {
    uint64_t *slots;        /* open addressing: 0, or the hash's top 32 bits and entry + 1 */
    long mask;              /* slots - 1 (a power of two) */
    entry *e;
    long entries, capacity, max_words;
    uint8_t *keys;
    long keys_used, keys_capacity;
    int32_t *ids;
    long ids_used, ids_capacity;
} table;

/* A word's hash, 8 bytes at a time. The 8 bytes at s + i may be read past the word's end when
 * they lie before `end` (the text's end), the bytes past the word then masked off. */
static uint64_t word_hash(const uint8_t *s, long n, const uint8_t *end) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n, w;
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0x9FB21C651E98DF25ULL;
        h ^= h >> 29;
    }
    if (i < n) {
        if (s + i + 8 <= end && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) {
            memcpy(&w, s + i, 8);
            w &= ~0ULL >> (8 * (8 - (n - i)));  /* little-endian: keep the first n - i bytes */
        } else {
            w = 0;
            memcpy(&w, s + i, (size_t)(n - i));
        }
        h = (h ^ w) * 0x9FB21C651E98DF25ULL;
        h ^= h >> 29;
    }
    h *= 0xD6E8FEB86659FD93ULL;
    return h ^ (h >> 32);
}

static int grow(void **p, long *capacity, long need, size_t item) {
    if (need <= *capacity) return 0;
    long c = *capacity ? *capacity : 1024;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * item);
    if (!q) return -1;
    *p = q;
    *capacity = c;
    return 0;
}

static inline uint64_t slot_of(uint64_t hash, long e) { return (hash & 0xFFFFFFFF00000000ULL) | (uint64_t)(e + 1); }

static void rebuild_slots(table *t) {
    memset(t->slots, 0, (size_t)(t->mask + 1) * sizeof(uint64_t));
    for (long e = 0; e < t->entries; e++) {
        long s = (long)(t->e[e].hash & (uint64_t)t->mask);
        while (t->slots[s]) s = (s + 1) & t->mask;
        t->slots[s] = slot_of(t->e[e].hash, e);
    }
}

void wt_free(table *t) {
    if (!t) return;
    free(t->slots); free(t->e); free(t->keys); free(t->ids); free(t);
}

table *wt_new(long max_words) {
    table *t = calloc(1, sizeof(table));
    if (!t) return NULL;
    t->max_words = max_words;
    t->mask = 1023;
    t->slots = calloc(1024, sizeof(uint64_t));
    if (!t->slots) { wt_free(t); return NULL; }
    return t;
}

/* The entry of key s[0:n] (its hash h), added without ids (ids_len -1) if the table lacks it;
 * -1 when out of memory. */
static long find_or_add(table *t, const uint8_t *s, long n, uint64_t h) {
    uint64_t tag = h & 0xFFFFFFFF00000000ULL;
    long slot = (long)(h & (uint64_t)t->mask);
    for (;;) {
        uint64_t v = t->slots[slot];
        if (!v) break;
        if ((v & 0xFFFFFFFF00000000ULL) == tag) {
            const entry *x = &t->e[(long)(v & 0xFFFFFFFFULL) - 1];
            if (x->hash == h && x->key_len == n && memcmp(t->keys + x->key_at, s, (size_t)n) == 0)
                return (long)(v & 0xFFFFFFFFULL) - 1;
        }
        slot = (slot + 1) & t->mask;
    }
    long e = t->entries;
    if (e >= INT32_MAX - 1) return -1;
    if (grow((void **)&t->e, &t->capacity, e + 1, sizeof(entry))) return -1;
    if (grow((void **)&t->keys, &t->keys_capacity, t->keys_used + n, 1)) return -1;
    memcpy(t->keys + t->keys_used, s, (size_t)n);
    t->e[e] = (entry){h, t->keys_used, 0, (int32_t)n, -1};
    t->keys_used += n;
    t->slots[slot] = slot_of(h, e);
    t->entries++;
    if (2 * t->entries > t->mask + 1) {  /* keep the load at most a half */
        long slots = 2 * (t->mask + 1);
        uint64_t *grown = realloc(t->slots, (size_t)slots * sizeof(uint64_t));
        if (!grown) return -1;
        t->slots = grown;
        t->mask = slots - 1;
        rebuild_slots(t);
    }
    return e;
}

/* The offsets of the ' ' and '\n' bytes in text[from:to] (to - from <= WINDOW) into at;
 * returns their number. */
static long word_ends(const uint8_t *text, long from, long to, long *at) {
    long k = 0, i = from;
#ifdef __AVX2__
    const __m256i space = _mm256_set1_epi8(' '), newline = _mm256_set1_epi8('\n');
    for (; i + 32 <= to; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(text + i));
        uint32_t bits = (uint32_t)_mm256_movemask_epi8(
            _mm256_or_si256(_mm256_cmpeq_epi8(v, space), _mm256_cmpeq_epi8(v, newline)));
        for (; bits; bits &= bits - 1) at[k++] = i + __builtin_ctz(bits);
    }
#endif
    for (; i < to; i++)
        if (text[i] == ' ' || text[i] == '\n') at[k++] = i;
    return k;
}

/* Bytes of text whose words are hashed before any is looked up, so that each lookup's slot is
 * fetched from memory AHEAD lookups before it is read. */
#define WINDOW 4096
#define AHEAD 8

/* Every word of text[0:n] (lines ended by '\n'): word_entry[w] is its entry (-2 for an empty
 * word: a ' ' after a ' ' or at a line's start, or an empty line) and line_end[w] is 1 when the
 * word ends its line. Entries added (first_new on) have no ids yet. Returns the number of
 * words, or -1 past `capacity` words or out of memory. */
long wt_scan(table *t, const uint8_t *text, long n, int32_t *word_entry, uint8_t *line_end,
             long capacity, long *first_new) {
    long ends[WINDOW];
    uint64_t hashes[WINDOW];
    *first_new = t->entries;
    long words = 0, start = 0;
    for (long from = 0; from < n; from += WINDOW) {
        long k = word_ends(text, from, from + WINDOW < n ? from + WINDOW : n, ends);
        if (words + k > capacity) return -1;
        for (long j = 0, s = start; j < k; s = ends[j++] + 1)
            hashes[j] = ends[j] > s ? word_hash(text + s, ends[j] - s, text + n) : 0;
        for (long j = 0; j < k; j++) {
            if (j + AHEAD < k) __builtin_prefetch(&t->slots[hashes[j + AHEAD] & (uint64_t)t->mask]);
            long e = ends[j] > start ? find_or_add(t, text + start, ends[j] - start, hashes[j]) : -2;
            if (e == -1) return -1;
            word_entry[words] = (int32_t)e;
            line_end[words] = text[ends[j]] == '\n';
            words++;
            start = ends[j] + 1;
        }
    }
    return words;
}

/* The key of entry e: its bytes and length. */
const uint8_t *wt_key(table *t, long e, long *length) {
    *length = t->e[e].key_len;
    return t->keys + t->e[e].key_at;
}

/* The ids of entries first to first + count - 1: `lengths[k]` of them each, one after another
 * in flat. Returns 0, or -1 out of memory. */
int wt_set_ids(table *t, long first, long count, const int32_t *flat, const int64_t *lengths) {
    long total = 0;
    for (long k = 0; k < count; k++) total += lengths[k];
    if (grow((void **)&t->ids, &t->ids_capacity, t->ids_used + total, sizeof(int32_t))) return -1;
    memcpy(t->ids + t->ids_used, flat, (size_t)total * sizeof(int32_t));
    for (long k = 0; k < count; k++) {
        t->e[first + k].ids_at = t->ids_used;
        t->e[first + k].ids_len = (int32_t)lengths[k];
        t->ids_used += lengths[k];
    }
    return 0;
}

/* The number of ids of `words` words (wt_scan's word_entry). */
long wt_count(table *t, const int32_t *word_entry, long words) {
    long total = 0;
    for (long w = 0; w < words; w++) {
        if (w + AHEAD < words && word_entry[w + AHEAD] >= 0) __builtin_prefetch(&t->e[word_entry[w + AHEAD]]);
        if (word_entry[w] >= 0) total += t->e[word_entry[w]].ids_len;
    }
    return total;
}

/* Write the ids of `words` words to out (itemsize 2 or 4 bytes each) and each line's number of
 * ids to lengths. */
void wt_emit(table *t, const int32_t *word_entry, const uint8_t *line_end, long words, void *out,
             int itemsize, int64_t *lengths) {
    long at = 0, line = 0, count = 0;
    for (long w = 0; w < words; w++) {
        int32_t e = word_entry[w];
        if (w + AHEAD < words && word_entry[w + AHEAD] >= 0) {
            const entry *next = &t->e[word_entry[w + AHEAD]];
            __builtin_prefetch(t->ids + next->ids_at);
        }
        if (e >= 0) {
            const int32_t *ids = t->ids + t->e[e].ids_at;
            long m = t->e[e].ids_len;
            if (itemsize == 2) {
                uint16_t *o = (uint16_t *)out + at;
                for (long k = 0; k < m; k++) o[k] = (uint16_t)ids[k];
            } else {
                memcpy((int32_t *)out + at, ids, (size_t)m * sizeof(int32_t));
            }
            at += m;
            count += m;
        }
        if (line_end[w]) {
            lengths[line++] = count;
            count = 0;
        }
    }
}

/* Keep the first max_words entries only (the words met first). */
void wt_end_block(table *t) {
    if (t->entries <= t->max_words) return;
    long keep = t->max_words;
    t->keys_used = keep ? t->e[keep - 1].key_at + t->e[keep - 1].key_len : 0;
    long ids_end = 0;
    for (long e = 0; e < keep; e++)
        if (t->e[e].ids_at + t->e[e].ids_len > ids_end) ids_end = t->e[e].ids_at + t->e[e].ids_len;
    t->ids_used = ids_end;
    t->entries = keep;
    rebuild_slots(t);
}

/* The number of words in text[0:n]: its ' ' and '\n' bytes. */
long wt_count_words(const uint8_t *text, long n) {
    long count = 0;
    for (long i = 0; i < n; i++) count += (text[i] == ' ') | (text[i] == '\n');
    return count;
}

/* The entries in the table. */
long wt_entries(table *t) { return t->entries; }

/* The keys of entries first on, one after another (keys are stored in the order their entries
 * were added), with each one's length in lengths. */
const uint8_t *wt_keys_from(table *t, long first, int64_t *lengths) {
    for (long e = first; e < t->entries; e++) lengths[e - first] = t->e[e].key_len;
    return t->keys + (first < t->entries ? t->e[first].key_at : t->keys_used);
}

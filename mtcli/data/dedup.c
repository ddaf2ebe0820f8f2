/* The dedup memory's table (mtcli/data/dedup.py): 64-bit pair keys in an open-addressing
 * hash table with linear probing. The table is a numpy array owned by Python, 2^bits slots,
 * 0 marking an empty slot; the key 0 itself is remembered in a flag beside it. */

#include <stdint.h>

/* A key's home slot: its top bits after a multiply by an odd constant, so keys that differ
 * only in their low bits still spread over the table. */
static inline uint64_t home(uint64_t key, int shift) {
    return (key * 0xD6E8FEB86659FD93ull) >> shift;
}

/* Looks ahead this many keys to fetch their slots' cache lines before they are probed: the
 * table is larger than the caches, and a miss costs a hundred nanoseconds. */
#define AHEAD 16

/* Adds keys[0..n) to the table (the key 0 to *has_zero); fresh[i] = 1 where keys[i] was neither
 * in the table nor earlier in keys, else 0. The caller keeps the table at most 3/4 full after
 * the call. Returns how many keys were added. */
long ks_add(uint64_t *table, int bits, uint8_t *has_zero, const uint64_t *keys, long n,
            uint8_t *fresh) {
    const uint64_t mask = (1ull << bits) - 1;
    const int shift = 64 - bits;
    long added = 0;
    for (long i = 0; i < n; i++) {
        if (i + AHEAD < n) __builtin_prefetch(&table[home(keys[i + AHEAD], shift)], 1);
        const uint64_t key = keys[i];
        if (key == 0) {
            fresh[i] = !*has_zero;
            added += fresh[i];
            *has_zero = 1;
            continue;
        }
        uint64_t s = home(key, shift);
        for (;;) {
            const uint64_t held = table[s];
            if (held == 0) {
                table[s] = key;
                fresh[i] = 1;
                added++;
                break;
            }
            if (held == key) {
                fresh[i] = 0;
                break;
            }
            s = (s + 1) & mask;
        }
    }
    return added;
}

/* Puts the keys of an old table (old_size slots) into an empty larger one of 2^bits slots. */
void ks_rehash(const uint64_t *old, long old_size, uint64_t *table, int bits) {
    const uint64_t mask = (1ull << bits) - 1;
    const int shift = 64 - bits;
    for (long i = 0; i < old_size; i++) {
        if (i + AHEAD < old_size && old[i + AHEAD])
            __builtin_prefetch(&table[home(old[i + AHEAD], shift)], 1);
        const uint64_t key = old[i];
        if (key == 0) continue;
        uint64_t s = home(key, shift);
        while (table[s] != 0) s = (s + 1) & mask;
        table[s] = key;
    }
}

/* The shard format's checksums in one native pass: erasure/fastsum.py loads this (built by
 * `make native`; without it the same functions run through python-xxhash).
 *
 * Why native: on the H200 host a core copies about 5 GB/s and python-xxhash (SSE2) hashes
 * about 6-9 GB/s, and each copy and each hash is one Python call that releases and retakes the
 * GIL. A local read lands about 16 shards per node answer: here their copies are ONE call
 * without the GIL, and a batch read's block checks one call over threads (XXH3 built for this
 * machine's SIMD, -march=native). The results are bit-identical to python-xxhash's (tests
 * compare them).
 *
 * Needs xxhash.h (Debian: libxxhash-dev), compiled inline: no library to load at run time.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define FIELDS_BYTES 40  /* the shard header bytes the checksum covers before the payload */

/* n copies in one call (without the GIL): len[i] bytes src[i] -> dst[i]. */
void kv_copy_many(size_t n, const uint8_t *const *src, uint8_t *const *dst, const uint64_t *len) {
    for (size_t i = 0; i < n; i++) {
        memcpy(dst[i], src[i], len[i]);
    }
}

/* xxh3-64 of fields (40 bytes) || payload: the shard checksum (erasure/shard.py). */
uint64_t kv_shard_checksum(const uint8_t *fields, const uint8_t *payload, size_t len) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, fields, FIELDS_BYTES);
    XXH3_64bits_update(&state, payload, len);
    return XXH3_64bits_digest(&state);
}

/* xxh3-128 of a block in canonical (big-endian) form: python-xxhash's xxh3_128_digest. */
void kv_xxh3_128(const uint8_t *data, size_t len, uint8_t out[16]) {
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits(data, len));
    memcpy(out, canonical.digest, 16);
}

/* Block checks of a batch read: ok[i] = 1 when xxh3-128 of blocks[i] (lens[i] bytes, canonical
 * form) equals versions[16 i ..]. Spread over up to num_threads threads (blocks i, i + T, ...),
 * so a batch of blocks landing in place is verified in one call at memory speed. */
struct verify_job {
    size_t n, first, step;
    const uint8_t *const *blocks;
    const uint64_t *lens;
    const uint8_t *versions;
    uint8_t *ok;
};

static void *verify_some(void *arg) {
    struct verify_job *job = arg;
    for (size_t i = job->first; i < job->n; i += job->step) {
        uint8_t digest[16];
        kv_xxh3_128(job->blocks[i], job->lens[i], digest);
        job->ok[i] = memcmp(digest, job->versions + 16 * i, 16) == 0;
    }
    return NULL;
}

void kv_verify_blocks(size_t n, const uint8_t *const *blocks, const uint64_t *lens,
                      const uint8_t *versions, uint8_t *ok, size_t num_threads) {
    if (num_threads > n) num_threads = n;
    if (num_threads > 64) num_threads = 64;
    if (num_threads <= 1) {
        struct verify_job job = {n, 0, 1, blocks, lens, versions, ok};
        verify_some(&job);
        return;
    }
    pthread_t threads[64];
    struct verify_job jobs[64];
    size_t started = 0;
    for (size_t t = 0; t < num_threads; t++) {
        jobs[t] = (struct verify_job){n, t, num_threads, blocks, lens, versions, ok};
        if (t > 0 && pthread_create(&threads[t], NULL, verify_some, &jobs[t]) == 0) {
            started |= (size_t)1 << t;
        } else if (t > 0) {
            verify_some(&jobs[t]); /* no thread: do its share here */
        }
    }
    verify_some(&jobs[0]);
    for (size_t t = 1; t < num_threads; t++)
        if (started & ((size_t)1 << t)) pthread_join(threads[t], NULL);
}

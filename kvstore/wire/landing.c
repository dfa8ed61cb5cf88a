/* The landing's native half: a node's batch read loop, and the permit words that guard the
 * client's landing pool. kvstore/wire/native_landing.py loads this (built by `make native`;
 * without it the node reads through Python and the client lands through its own arena).
 *
 * Why native: a local batch read puts tens of shards of a few hundred KB each straight into the
 * client's memory. In Python each shard costs a preadv call, a record-header parse and a
 * checksum call, each taking and dropping the GIL; here the whole request is ONE call without
 * the GIL: per shard one preadv (record header + shard header into a small buffer, the payload
 * to its final place), the record header checked (key, tenant, its own xxh3-64), then the
 * shard's xxh3-64 over the payload while it is in cache and its version against the index.
 *
 * Permit words (one u32 per request, in the client's shared arena) make a late write
 * impossible: a node writes into the landing pool only after it moved its request's word from
 * ARMED to WRITING with a compare-and-swap, and the client gives up on a request by moving the
 * same word from ARMED to REVOKED. Exactly one of the two wins. A word carries a generation in
 * its upper 30 bits, so a reused word never admits a stale request:
 *
 *     word = generation << 2 | state      state: 0 REVOKED (or free), 1 ARMED, 2 WRITING, 3 DONE
 *
 * Needs xxhash.h (Debian: libxxhash-dev), compiled inline.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

enum {
    RL_OK = 0,
    RL_SHORT = 1,         /* the segment ends inside the record */
    RL_BAD_RECORD = 2,    /* the record header is not this key's and tenant's, or torn */
    RL_BAD_SHARD = 3,     /* the shard fails its own checksum or header */
    RL_WRONG_VERSION = 4, /* intact, but not the version the index names */
    RL_IO = 5,            /* preadv failed: errnos[i] says why */
    RL_REVOKED = 6,       /* the client revoked the permit before the node could claim it */
};

#define STATE_MASK 3u
#define WRITING 2u
#define DONE 3u
#define RECORD_FIXED 52     /* record header bytes before the class and tenant names */
#define SHARD_HEADER 48
#define SHARD_FIELDS 40     /* shard header bytes the shard checksum covers */
#define MAX_HEAD 4096

static uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Compare-and-swap on a permit word; returns the value it held (== expected: it swapped). */
uint32_t kv_permit_cas(uint32_t *word, uint32_t expected, uint32_t desired) {
    __atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
    return expected;
}

uint32_t kv_permit_load(const uint32_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

void kv_permit_store(uint32_t *word, uint32_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

/* Whether head[0 .. header_bytes) is an intact format-2 record header of this key and tenant
 * for a shard of shard_bytes bytes (kvstore/store/segments.py has the layout). */
static int record_ok(const uint8_t *head, uint32_t header_bytes, const uint8_t *key,
                     const uint8_t *tenant_hash, const uint8_t *tenant, uint32_t tenant_len,
                     uint64_t shard_bytes) {
    if (header_bytes < RECORD_FIXED + 8 || memcmp(head, "KVR2", 4) != 0) return 0;
    uint32_t class_len = head[48];
    uint32_t name_len = (uint32_t)head[50] | ((uint32_t)head[51] << 8);
    uint32_t end = RECORD_FIXED + class_len + name_len;
    if (end + 8 != header_bytes || name_len != tenant_len) return 0;
    if (load_u32(head + 4) != shard_bytes || memcmp(head + 8, key, 16) != 0) return 0;
    if (memcmp(head + 24, tenant_hash, 8) != 0) return 0;
    if (memcmp(head + RECORD_FIXED + class_len, tenant, tenant_len) != 0) return 0;
    return XXH3_64bits(head, end) == load_u64(head + end);
}

/* The shard header's verdict on the payload just read: RL_OK, RL_BAD_SHARD or
 * RL_WRONG_VERSION (erasure/shard.py has the layout). */
static int shard_ok(const uint8_t *shard_head, const uint8_t *payload, uint64_t payload_bytes,
                    const uint8_t *version) {
    if (memcmp(shard_head, "KVSH", 4) != 0 || load_u32(shard_head + 36) != payload_bytes)
        return RL_BAD_SHARD;
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, shard_head, SHARD_FIELDS);
    XXH3_64bits_update(&state, payload, payload_bytes);
    if (XXH3_64bits_digest(&state) != load_u64(shard_head + SHARD_FIELDS)) return RL_BAD_SHARD;
    return memcmp(shard_head + 20, version, 16) == 0 ? RL_OK : RL_WRONG_VERSION;
}

/* One record: preadv its header and payload, check both (the RL_ code of it). */
static uint8_t read_one(int32_t fd, uint64_t offset, uint32_t hb, uint64_t payload_bytes,
                        uint8_t *dest, const uint8_t *key, const uint8_t *version,
                        const uint8_t *tenant_hash, const uint8_t *tenant, uint32_t tenant_len,
                        uint8_t *shard_header, int32_t *error) {
    uint8_t head[MAX_HEAD + SHARD_HEADER];
    if (hb > MAX_HEAD) return RL_BAD_RECORD;
    struct iovec iov[2] = {{head, hb + SHARD_HEADER}, {dest, payload_bytes}};
    ssize_t want = (ssize_t)(hb + SHARD_HEADER + payload_bytes);
    ssize_t got = preadv(fd, iov, 2, (off_t)offset);
    if (got < 0) {
        *error = errno;
        return RL_IO;
    }
    memcpy(shard_header, head + hb, SHARD_HEADER);
    if (got != want) return RL_SHORT;
    if (!record_ok(head, hb, key, tenant_hash, tenant, tenant_len, SHARD_HEADER + payload_bytes))
        return RL_BAD_RECORD;
    return (uint8_t)shard_ok(head + hb, dest, payload_bytes, version);
}

struct read_job {
    size_t first, step, n;
    const int32_t *fds;
    const uint64_t *offsets;
    const uint32_t *header_bytes;
    const uint64_t *payload_bytes;
    uint8_t *const *dests;
    const uint8_t *skip;  /* 1: not read (a pool write the permit does not allow) */
    const uint8_t *keys, *versions, *tenant_hash, *tenant;
    uint32_t tenant_len;
    uint8_t *shard_headers, *status;
    int32_t *errnos;
};

static void *read_some(void *arg) {
    struct read_job *j = arg;
    for (size_t i = j->first; i < j->n; i += j->step) {
        j->errnos[i] = 0;
        if (j->skip[i]) {
            j->status[i] = RL_REVOKED;
            continue;
        }
        j->status[i] = read_one(j->fds[i], j->offsets[i], j->header_bytes[i],
                                j->payload_bytes[i], j->dests[i], j->keys + 16 * i,
                                j->versions + 16 * i, j->tenant_hash, j->tenant, j->tenant_len,
                                j->shard_headers + SHARD_HEADER * i, &j->errnos[i]);
    }
    return NULL;
}

#define MAX_THREADS 16

/* Read n shard records: record i lies at offsets[i] of fds[i], its header header_bytes[i]
 * long, its payload payload_bytes[i] long; the payload goes to dests[i] and the 48-byte shard
 * header to shard_headers[48 i ..]. status[i] is one of the RL_ codes (errnos[i] for RL_IO).
 *
 * Payloads with in_pool[i] set go to the client's landing pool: before anything is read the
 * permit word is moved from permit_armed to WRITING; if that fails (revoked) none of them is
 * read (RL_REVOKED), and once every record is read a claimed word is set to DONE. permit may
 * be NULL when no in_pool item is given. The records are spread over up to num_threads
 * threads (records i, i + T, ...): a node answers a large request sooner, its work the same.
 * Returns how many records are RL_OK. */
size_t kv_read_records(size_t n, const int32_t *fds, const uint64_t *offsets,
                       const uint32_t *header_bytes, const uint64_t *payload_bytes,
                       uint8_t *const *dests, const uint8_t *in_pool, const uint8_t *keys,
                       const uint8_t *versions, const uint8_t *tenant_hash,
                       const uint8_t *tenant, uint32_t tenant_len, uint32_t *permit,
                       uint32_t permit_armed, uint8_t *shard_headers, uint8_t *status,
                       int32_t *errnos, size_t num_threads) {
    int wants_pool = 0, claimed = 0;
    for (size_t i = 0; i < n; i++) wants_pool |= in_pool[i];
    if (wants_pool && permit != NULL) {
        uint32_t writing = (permit_armed & ~STATE_MASK) | WRITING;
        claimed = kv_permit_cas(permit, permit_armed, writing) == permit_armed;
    }
    /* Records the permit does not allow are skipped: in_pool without a claimed permit. */
    const uint8_t *skip = claimed ? NULL : in_pool;
    uint8_t none[1] = {0};
    uint8_t *zeros = NULL;
    if (skip == NULL) {
        zeros = n <= 1 ? none : calloc(n, 1);
        if (zeros == NULL) return 0;
        skip = zeros;
    }
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > n) num_threads = n;
    if (num_threads < 1) num_threads = 1;
    struct read_job jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (size_t t = 0; t < num_threads; t++) {
        jobs[t] = (struct read_job){t, num_threads, n, fds, offsets, header_bytes,
                                    payload_bytes, dests, skip, keys, versions, tenant_hash,
                                    tenant, tenant_len, shard_headers, status, errnos};
        if (t > 0) started[t] = pthread_create(&threads[t], NULL, read_some, &jobs[t]) == 0;
        if (t > 0 && !started[t]) read_some(&jobs[t]);
    }
    read_some(&jobs[0]);
    for (size_t t = 1; t < num_threads; t++)
        if (started[t]) pthread_join(threads[t], NULL);
    if (claimed) kv_permit_store(permit, (permit_armed & ~STATE_MASK) | DONE);
    if (zeros != NULL && zeros != none) free(zeros);
    size_t num_ok = 0;
    for (size_t i = 0; i < n; i++) num_ok += status[i] == RL_OK;
    return num_ok;
}

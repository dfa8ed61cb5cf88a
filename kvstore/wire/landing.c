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

/* Read n shard records: record i lies at offsets[i] of fds[i], its header header_bytes[i]
 * long, its payload payload_bytes[i] long; the payload goes to dests[i] and the 48-byte shard
 * header to shard_headers[48 i ..]. status[i] is one of the RL_ codes (errnos[i] for RL_IO).
 *
 * A payload with in_pool[i] set goes to the client's landing pool: before the first such
 * write the permit word is moved from permit_armed to permit_armed + 1 (WRITING); if that
 * fails (revoked) no such payload is read (RL_REVOKED), and once the loop is over a claimed
 * word is set to DONE. permit may be NULL when no in_pool item is given. Returns how many
 * records are RL_OK. */
size_t kv_read_records(size_t n, const int32_t *fds, const uint64_t *offsets,
                       const uint32_t *header_bytes, const uint64_t *payload_bytes,
                       uint8_t *const *dests, const uint8_t *in_pool, const uint8_t *keys,
                       const uint8_t *versions, const uint8_t *tenant_hash,
                       const uint8_t *tenant, uint32_t tenant_len, uint32_t *permit,
                       uint32_t permit_armed, uint8_t *shard_headers, uint8_t *status,
                       int32_t *errnos) {
    uint8_t head[MAX_HEAD + SHARD_HEADER];
    int claimed = 0, revoked = 0;
    size_t num_ok = 0;
    for (size_t i = 0; i < n; i++) {
        errnos[i] = 0;
        if (in_pool[i] && !claimed) {
            if (revoked || permit == NULL) {
                status[i] = RL_REVOKED;
                continue;
            }
            uint32_t writing = (permit_armed & ~STATE_MASK) | WRITING;
            if (kv_permit_cas(permit, permit_armed, writing) != permit_armed) {
                revoked = 1;
                status[i] = RL_REVOKED;
                continue;
            }
            claimed = 1;
        }
        uint32_t hb = header_bytes[i];
        if (hb > MAX_HEAD) {
            status[i] = RL_BAD_RECORD;
            continue;
        }
        struct iovec iov[2] = {{head, hb + SHARD_HEADER}, {dests[i], payload_bytes[i]}};
        ssize_t want = (ssize_t)(hb + SHARD_HEADER + payload_bytes[i]);
        ssize_t got = preadv(fds[i], iov, 2, (off_t)offsets[i]);
        if (got < 0) {
            status[i] = RL_IO;
            errnos[i] = errno;
            continue;
        }
        memcpy(shard_headers + SHARD_HEADER * i, head + hb, SHARD_HEADER);
        if (got != want) {
            status[i] = RL_SHORT;
            continue;
        }
        if (!record_ok(head, hb, keys + 16 * i, tenant_hash, tenant, tenant_len,
                       SHARD_HEADER + payload_bytes[i])) {
            status[i] = RL_BAD_RECORD;
            continue;
        }
        status[i] = (uint8_t)shard_ok(head + hb, dests[i], payload_bytes[i], versions + 16 * i);
        num_ok += status[i] == RL_OK;
    }
    if (claimed) kv_permit_store(permit, (permit_armed & ~STATE_MASK) | DONE);
    return num_ok;
}

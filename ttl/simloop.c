/* The simulator's per-access loop in C: visit, lazy expiry, capacity eviction, live counts.
 * ttl/simloop.py loads this (built by `make native`); without it ttl/simulator.py's pure-Python
 * pass runs, with the same semantics, and a property test checks the two agree.
 *
 * Why C: a pass costs a few list operations per block access, and with partitions a few
 * microseconds of Python per visit (a request touches nearly every partition). Here a visit
 * costs tens of nanoseconds, so P partitions cost what one process costs.
 *
 * The algorithm is ttl/sim_python.py's PythonPass, line for line (its docstrings say why it is
 * correct): dense block ids; per block its class (-1: not resident) and the queue entry that
 * holds its last touch (entry = visit * num_classes + class); per class a queue of visits in
 * time order, which expiry and eviction consume lazily from its head, skipping blocks whose
 * entry moved on. No allocation per access; queues and the output records grow by doubling.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t *data;
    int64_t len, cap;
} vec_t;

typedef struct {
    /* inputs, owned by the caller (numpy arrays that outlive the state) */
    int64_t num_visits, num_classes;
    const double *times;   /* [visits] relative request times */
    const int32_t *classes; /* [visits] */
    const int64_t *starts, *lengths; /* [visits] into ids */
    const int32_t *ids;
    double ttl_s[64];
    int64_t capacity; /* -1: none */
    int lru;
    double window_start_s;
    /* state */
    int32_t *block_class;
    int64_t *block_entry;
    vec_t queues[64];
    int64_t heads[64], cursors[64], live_by_class[64];
    int64_t live;
    double next_expiry_s;
    int counting, failed;
    /* outputs */
    vec_t misses;    /* visit, index in the visit, blocks inserted */
    vec_t evictions; /* visit, class, blocks */
    vec_t expiries;  /* instant (double bits), class, blocks */
    double block_seconds[64];
    int64_t expired[64], evicted[64];
} sim_t;

static void push(sim_t *s, vec_t *v, int64_t x) {
    if (v->len == v->cap) {
        int64_t cap = v->cap ? 2 * v->cap : 1024;
        int64_t *data = realloc(v->data, cap * sizeof(int64_t));
        if (!data) { s->failed = 1; return; }
        v->data = data;
        v->cap = cap;
    }
    v->data[v->len++] = x;
}

static void push3(sim_t *s, vec_t *v, int64_t a, int64_t b, int64_t c) {
    push(s, v, a);
    push(s, v, b);
    push(s, v, c);
}

void sim_free(sim_t *s) {
    if (!s) return;
    free(s->block_class);
    free(s->block_entry);
    for (int k = 0; k < 64; k++) free(s->queues[k].data);
    free(s->misses.data);
    free(s->evictions.data);
    free(s->expiries.data);
    free(s);
}

sim_t *sim_new(int64_t num_visits, int64_t num_classes, int64_t num_blocks, const double *times,
               const int32_t *classes, const int64_t *starts, const int64_t *lengths,
               const int32_t *ids, const double *ttl_s, int64_t capacity, int lru,
               double window_start_s) {
    if (num_classes > 64) return NULL;
    sim_t *s = calloc(1, sizeof(sim_t));
    if (!s) return NULL;
    s->num_visits = num_visits;
    s->num_classes = num_classes;
    s->times = times;
    s->classes = classes;
    s->starts = starts;
    s->lengths = lengths;
    s->ids = ids;
    memcpy(s->ttl_s, ttl_s, num_classes * sizeof(double));
    s->capacity = capacity;
    s->lru = lru;
    s->window_start_s = window_start_s;
    s->next_expiry_s = INFINITY;
    s->block_class = malloc((num_blocks ? num_blocks : 1) * sizeof(int32_t));
    s->block_entry = malloc((num_blocks ? num_blocks : 1) * sizeof(int64_t));
    if (!s->block_class || !s->block_entry) { sim_free(s); return NULL; }
    memset(s->block_class, 0xff, num_blocks * sizeof(int32_t));
    memset(s->block_entry, 0xff, num_blocks * sizeof(int64_t));
    /* at most one miss record per visit: reserved, so the loop never grows it */
    s->misses.cap = 3 * (num_visits ? num_visits : 1);
    s->misses.data = malloc(s->misses.cap * sizeof(int64_t));
    if (!s->misses.data) { sim_free(s); return NULL; }
    return s;
}

static void record_deaths(sim_t *s, int64_t k, int64_t num, double death_s, int evicted) {
    s->live_by_class[k] -= num;
    if (!s->counting) return;
    s->block_seconds[k] += num * (death_s > s->window_start_s ? death_s : s->window_start_s);
    if (evicted) s->evicted[k] += num;
    else if (death_s >= s->window_start_s) s->expired[k] += num;
}

/* Queue k's front visit, its entry, and the [position, end) of its unconsumed blocks. */
static int64_t front(sim_t *s, int64_t k, int64_t *position, int64_t *end) {
    int64_t v = s->queues[k].data[s->heads[k]];
    int64_t start = s->starts[v];
    *position = s->cursors[k] > start ? s->cursors[k] : start;
    *end = start + s->lengths[v];
    return v * s->num_classes + k;
}

static int64_t drop_front(sim_t *s, int64_t k, double expires_at_s) {
    int64_t position, end, entry = front(s, k, &position, &end), num = 0;
    for (; position < end; position++) {
        int32_t b = s->ids[position];
        if (s->block_entry[b] == entry) {
            s->block_class[b] = -1;
            s->block_entry[b] = -1;
            num++;
        }
    }
    s->heads[k]++;
    if (num) {
        int64_t bits;
        memcpy(&bits, &expires_at_s, sizeof bits);
        push3(s, &s->expiries, bits, k, num);
        record_deaths(s, k, num, expires_at_s, 0);
    }
    return num;
}

static int64_t expire(sim_t *s, double now) {
    int64_t num = 0;
    double next = INFINITY;
    for (int64_t k = 0; k < s->num_classes; k++) {
        vec_t *q = &s->queues[k];
        while (s->heads[k] < q->len) {
            double expires_at_s = s->times[q->data[s->heads[k]]] + s->ttl_s[k];
            if (!(now >= expires_at_s)) {
                if (expires_at_s < next) next = expires_at_s;
                break;
            }
            num += drop_front(s, k, expires_at_s);
        }
    }
    s->next_expiry_s = next;
    return num;
}

static double front_priority(sim_t *s, int64_t k) {
    double last_s = s->times[s->queues[k].data[s->heads[k]]];
    double expires_at_s = last_s + s->ttl_s[k];
    return (!s->lru || isinf(expires_at_s)) ? expires_at_s : last_s;
}

/* The class whose next live block is evicted first; leaves its cursor on that block. A queue's
 * priorities never fall from front to back, so only the winner's front needs checking; while
 * its front holds nothing live it moves on, and only its own priority changes. */
static int64_t lowest_priority_class(sim_t *s) {
    double priority[64];
    for (int64_t k = 0; k < s->num_classes; k++)
        priority[k] = s->live_by_class[k] ? front_priority(s, k) : INFINITY;
    for (;;) {
        int64_t best = -1;
        for (int64_t k = 0; k < s->num_classes; k++)
            if (s->live_by_class[k] && (best < 0 || priority[k] < priority[best])) best = k;
        if (best < 0) return -1;
        int64_t position, end, entry = front(s, best, &position, &end);
        for (; position < end; position++)
            if (s->block_entry[s->ids[position]] == entry) break;
        if (position < end) {
            s->cursors[best] = position;
            return best;
        }
        s->heads[best]++; /* nothing live in it: its priority may rise */
        priority[best] = front_priority(s, best);
    }
}

static void evict(sim_t *s, int64_t num, double now, int64_t v) {
    while (num) {
        int64_t k = lowest_priority_class(s);
        if (k < 0) { s->failed = 2; return; } /* the live count is off */
        int64_t position, end, entry = front(s, k, &position, &end), wanted = num;
        for (; num && position < end; position++) {
            int32_t b = s->ids[position];
            if (s->block_entry[b] == entry) {
                s->block_class[b] = -1;
                s->block_entry[b] = -1;
                num--;
            }
        }
        s->cursors[k] = position;
        push3(s, &s->evictions, v, k, wanted - num);
        record_deaths(s, k, wanted - num, now, 1);
    }
}

static void touch_foreign(sim_t *s, int32_t b, int64_t k, int64_t v) {
    s->block_entry[b] = v * s->num_classes + k;
    vec_t *q = &s->queues[k];
    if (q->data[q->len - 1] != v) push(s, q, v);
}

/* Visits [begin, end); returns 0, or nonzero when memory ran out or a count was off. */
int sim_visit(sim_t *s, int64_t begin, int64_t end) {
    const int32_t *ids = s->ids;
    int32_t *block_class = s->block_class;
    int64_t *block_entry = s->block_entry;
    for (int64_t v = begin; v < end && !s->failed; v++) {
        double now = s->times[v];
        int64_t c = s->classes[v], entry = v * s->num_classes + c;
        if (now >= s->next_expiry_s) s->live -= expire(s, now);
        push(s, &s->queues[c], v);
        double expires_s = now + s->ttl_s[c];
        if (expires_s < s->next_expiry_s) s->next_expiry_s = expires_s;
        int64_t i = s->starts[v], stop = i + s->lengths[v];
        for (; i < stop; i++) { /* the prefix hit: leading resident blocks, touched */
            int32_t b = ids[i];
            int32_t k = block_class[b];
            if (k == c) block_entry[b] = entry;
            else if (k < 0) break;
            else touch_foreign(s, b, k, v);
        }
        if (i == stop) continue; /* every block hit: nothing inserted */
        int64_t miss_index = i - s->starts[v], num_new = 0;
        for (; i < stop; i++) { /* the rest: insert missing blocks, touch resident ones */
            int32_t b = ids[i];
            int32_t k = block_class[b];
            if (k == c) block_entry[b] = entry;
            else if (k < 0) {
                block_class[b] = (int32_t)c;
                block_entry[b] = entry;
                num_new++;
            } else touch_foreign(s, b, k, v);
        }
        push3(s, &s->misses, v, miss_index, num_new);
        s->live_by_class[c] += num_new;
        s->live += num_new;
        if (s->capacity >= 0 && s->live > s->capacity) {
            evict(s, s->live - s->capacity, now, v);
            s->live = s->capacity;
        }
    }
    return s->failed;
}

/* Start counting: the blocks resident now count from the window's start. */
void sim_start_window(sim_t *s) {
    s->counting = 1;
    for (int64_t k = 0; k < s->num_classes; k++)
        s->block_seconds[k] = -(double)s->live_by_class[k] * s->window_start_s;
}

int sim_finish(sim_t *s, double end_s) {
    s->live -= expire(s, end_s);
    return s->failed;
}

/* Record counts: misses, evictions, expiries (each a record of 3 int64). */
void sim_sizes(const sim_t *s, int64_t *out) {
    out[0] = s->misses.len / 3;
    out[1] = s->evictions.len / 3;
    out[2] = s->expiries.len / 3;
}

/* Copy the records out; per class block_seconds, expired and evicted counts. */
void sim_results(const sim_t *s, int64_t *misses, int64_t *evictions, int64_t *expiries,
                 double *block_seconds, int64_t *expired, int64_t *evicted) {
    memcpy(misses, s->misses.data, s->misses.len * sizeof(int64_t));
    memcpy(evictions, s->evictions.data, s->evictions.len * sizeof(int64_t));
    memcpy(expiries, s->expiries.data, s->expiries.len * sizeof(int64_t));
    memcpy(block_seconds, s->block_seconds, s->num_classes * sizeof(double));
    memcpy(expired, s->expired, s->num_classes * sizeof(int64_t));
    memcpy(evicted, s->evicted, s->num_classes * sizeof(int64_t));
}

/* --- the store's placement: rendezvous over xxh3_64 (kvstore.placement) -----------------------
 * Each 16-byte key goes to the group with the highest xxh3_64(group id (u32 LE) || key); the
 * 20-byte case of XXH3 with its default secret, as groups_of_keys computes it in numpy, so the
 * two agree bit for bit. With group weights, the lowest -log(u) / weight, u the score scaled
 * into (0, 1), computed as kvstore.placement.group_of_key does in Python (the same libm log,
 * the same double operations in the same order), so the two agree bit for bit too. Tests:
 * tests/kvstore/cli/test_sim_partitions.py. */
static const uint64_t XXH_SECRET[4] = {0xbe4ba423396cfeb8ULL, 0x1cad21f72c81017cULL,
                                       0xdb979083e96dd4deULL, 0x1f67b3b7a4a44072ULL};

static uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

/* weights: NULL (plain rendezvous) or [num_groups] integer weights. */
static int64_t rendezvous_group(uint64_t k0, uint64_t k1, int64_t num_groups,
                                const int64_t *weights) {
    const uint64_t len20 = 20ULL * 0x9E3779B185EBCA87ULL;
    uint64_t key_part = len20 + mul128_fold64(k0 ^ XXH_SECRET[2], k1 ^ XXH_SECRET[3]);
    uint64_t high_word = ((k0 >> 32) | (k1 << 32)) ^ XXH_SECRET[1];
    uint64_t low_key = (k0 & 0xFFFFFFFFULL) << 32;
    int64_t best = 0;
    uint64_t best_score = 0;
    double best_cost = INFINITY;
    for (int64_t g = 0; g < num_groups; g++) {
        uint64_t mixed = mul128_fold64((low_key | (uint64_t)g) ^ XXH_SECRET[0], high_word);
        uint64_t score = xxh3_avalanche(key_part + mixed);
        if (weights) {
            volatile double u = ((double)score + 0.5) * 0x1p-64; /* no fused or reordered math */
            double cost = -log(u) / (double)weights[g];
            if (cost < best_cost) { best = g; best_cost = cost; }
        } else if (g == 0 || score > best_score) {
            best = g;
            best_score = score;
        }
    }
    return best;
}

void sim_rendezvous(int64_t n, const uint64_t *keys, int64_t num_groups, const int64_t *weights,
                    int64_t *out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = rendezvous_group(keys[2 * i], keys[2 * i + 1], num_groups, weights);
}

/* --- chained block identities (ttl/traces.py chain_identities) ---------------------------------
 * identity_j = mix64(identity_{j-1}, id_j) along each request from mix64(root, 0), where
 * mix64(a, b) = splitmix64(a * GOLDEN ^ splitmix64(b)): the numpy version's arithmetic, one
 * pass in access order instead of one numpy pass per position. */
static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL;

static uint64_t splitmix64(uint64_t z) {
    z += GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint64_t mix64(uint64_t a, uint64_t b) { return splitmix64(a * GOLDEN ^ splitmix64(b)); }

void sim_chain(int64_t num_requests, const int64_t *lengths, const int64_t *ids,
               const int64_t *roots, uint64_t *out) {
    int64_t a = 0;
    for (int64_t r = 0; r < num_requests; r++) {
        uint64_t identity = mix64((uint64_t)roots[r], 0);
        for (int64_t j = 0; j < lengths[r]; j++, a++)
            out[a] = identity = mix64(identity, (uint64_t)ids[a]);
    }
}

/* --- splitting a unit's accesses by partition, in one pass (ttl/partition.py split_unit) -------
 * Pass 1, per access: its identity (the id, or chained from the request's root), its distinct
 * block (an open-addressing table keyed by identity; blocks numbered in order of first
 * appearance), and for a new block its partition (the store's rendezvous over the identity's
 * key, kvstore.cli.sim_partitions.identity_keys: mix64(identity, 0), mix64(identity, salt))
 * and its index among its partition's blocks. Pass 2: a stable counting sort of the accesses
 * by partition, each partition's in request then position order, with runs (one request's
 * accesses in one partition). The distinct identities come out grouped by partition, in order
 * of first appearance. Outputs are sized by the caller for every access ([accesses]); the
 * bounds arrays are [partitions + 1]. Returns 0, or 1 when memory ran out. */
static const uint64_t KEY_SALT = 0x6B7673746F726531ULL; /* "kvstore1" */

typedef struct {
    uint64_t identity;
    int64_t block; /* -1: empty */
} slot_t;

typedef struct {
    slot_t *slots;
    int64_t mask;
} table_t;

static int table_init(table_t *t, int64_t min_slots) {
    int64_t n = 1024;
    while (n < min_slots) n *= 2;
    t->slots = malloc(n * sizeof(slot_t));
    if (!t->slots) return 1;
    t->mask = n - 1;
    for (int64_t i = 0; i < n; i++) t->slots[i].block = -1;
    return 0;
}

/* The slot index keeps an identity's low bits: chained identities are well mixed already, and
 * ids numbered in order (Mooncake's) then probe neighbouring slots, in cache, as a request
 * reads its blocks one after another. */
static slot_t *table_find(const table_t *t, uint64_t identity) {
    int64_t i = (int64_t)(identity ^ (identity >> 32)) & t->mask;
    while (t->slots[i].block >= 0 && t->slots[i].identity != identity) i = (i + 1) & t->mask;
    return &t->slots[i];
}

/* Doubles the table (kept at most half full) from the identities of its blocks. */
static int table_grow(table_t *t, const uint64_t *identities, int64_t num_blocks) {
    free(t->slots);
    if (table_init(t, 2 * (t->mask + 1))) return 1;
    for (int64_t b = 0; b < num_blocks; b++) {
        slot_t *slot = table_find(t, identities[b]);
        slot->identity = identities[b];
        slot->block = b;
    }
    return 0;
}

typedef struct {
    int64_t num_partitions;
    const int64_t *weights;
    int64_t *block_group, *block_local, *group_count;
    uint64_t *identities;
    int64_t num_blocks;
    table_t table;
} dedupe_t;

/* The distinct block of ``identity``, placed when new; -1 when memory ran out. */
static int64_t block_of(dedupe_t *d, uint64_t identity) {
    slot_t *slot = table_find(&d->table, identity);
    if (slot->block >= 0) return slot->block;
    int64_t b = d->num_blocks++;
    slot->identity = identity;
    slot->block = b;
    d->identities[b] = identity;
    int64_t g = rendezvous_group(mix64(identity, 0), mix64(identity, KEY_SALT),
                                 d->num_partitions, d->weights);
    d->block_group[b] = g;
    d->block_local[b] = d->group_count[g]++;
    if (2 * d->num_blocks > d->table.mask + 1 &&
        table_grow(&d->table, d->identities, d->num_blocks))
        return -1;
    return b;
}

/* Pass 1: each access's distinct block into block_of_access; counts per partition. */
static int dedupe_accesses(dedupe_t *d, int64_t num_requests, const int64_t *lengths,
                           const int64_t *ids, const int64_t *roots, int32_t *block_of_access,
                           int64_t *access_bounds, int64_t *run_bounds, int64_t *last) {
    int64_t a = 0;
    for (int64_t r = 0; r < num_requests; r++) {
        uint64_t identity = roots ? mix64((uint64_t)roots[r], 0) : 0;
        for (int64_t j = 0; j < lengths[r]; j++, a++) {
            identity = roots ? mix64(identity, (uint64_t)ids[a]) : (uint64_t)ids[a];
            int64_t b = block_of(d, identity);
            if (b < 0) return 1;
            block_of_access[a] = (int32_t)b;
            int64_t g = d->block_group[b];
            access_bounds[g + 1]++;
            if (last[g] != r) { last[g] = r; run_bounds[g + 1]++; }
        }
    }
    return 0;
}

int sim_split_unit(int64_t num_requests, const int64_t *lengths, const int64_t *ids,
                   const int64_t *roots, int64_t num_accesses, int64_t num_partitions,
                   const int64_t *weights, int64_t *access_bounds, int64_t *run_bounds,
                   int64_t *distinct_bounds, int32_t *positions, int32_t *local_ids,
                   int32_t *run_rows, int32_t *run_lengths, uint64_t *distinct) {
    int64_t n = num_accesses ? num_accesses : 1, p_size = num_partitions * sizeof(int64_t);
    dedupe_t d = {num_partitions, weights, malloc(n * sizeof(int64_t)),
                  malloc(n * sizeof(int64_t)), calloc(num_partitions, sizeof(int64_t)),
                  malloc(n * sizeof(uint64_t)), 0, {NULL, 0}};
    int32_t *block_of_access = malloc(n * sizeof(int32_t));
    int64_t *last = malloc(p_size), *access_at = malloc(p_size), *run_at = malloc(p_size);
    int failed = !d.block_group || !d.block_local || !d.group_count || !d.identities ||
                 !block_of_access || !last || !access_at || !run_at ||
                 table_init(&d.table, num_accesses / 8);
    if (!failed) {
        memset(access_bounds, 0, (num_partitions + 1) * sizeof(int64_t));
        memset(run_bounds, 0, (num_partitions + 1) * sizeof(int64_t));
        for (int64_t p = 0; p < num_partitions; p++) last[p] = -1;
        failed = dedupe_accesses(&d, num_requests, lengths, ids, roots, block_of_access,
                                 access_bounds, run_bounds, last);
    }
    if (!failed) {
        distinct_bounds[0] = 0;
        for (int64_t p = 0; p < num_partitions; p++) {
            access_bounds[p + 1] += access_bounds[p];
            run_bounds[p + 1] += run_bounds[p];
            distinct_bounds[p + 1] = distinct_bounds[p] + d.group_count[p];
            access_at[p] = access_bounds[p];
            run_at[p] = run_bounds[p] - 1;
            last[p] = -1;
        }
        for (int64_t b = 0; b < d.num_blocks; b++)
            distinct[distinct_bounds[d.block_group[b]] + d.block_local[b]] = d.identities[b];
        int64_t a = 0;
        for (int64_t r = 0; r < num_requests; r++)
            for (int64_t j = 0; j < lengths[r]; j++, a++) {
                int64_t b = block_of_access[a], g = d.block_group[b], at = access_at[g]++;
                positions[at] = (int32_t)j;
                local_ids[at] = (int32_t)d.block_local[b];
                if (last[g] != r) {
                    last[g] = r;
                    run_rows[++run_at[g]] = (int32_t)r;
                    run_lengths[run_at[g]] = 0;
                }
                run_lengths[run_at[g]]++;
            }
    }
    free(d.block_group); free(d.block_local); free(d.group_count); free(d.identities);
    free(d.table.slots); free(block_of_access); free(last); free(access_at); free(run_at);
    return failed;
}

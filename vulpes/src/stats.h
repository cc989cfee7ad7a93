/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Where a chunk access was satisfied; also the "source" column of a trace. */
typedef enum StatsTier {
        STATS_TIER_RAM,
        STATS_TIER_CACHE,
        STATS_TIER_LOOKASIDE,
        STATS_TIER_SERVER,
        STATS_TIER_ZERO,        /* no keyring record: all zeros, no I/O */
        STATS_TIER_NEW,         /* a whole-chunk write that needed no read */
        STATS_TIER_PACK,        /* a read served from the resume pack (image_preload) */
        _STATS_TIER_MAX,
} StatsTier;

/* Fetch latency histogram bucket upper bounds in microseconds; the last bucket is open-ended. */
#define STATS_LATENCY_BUCKETS 14

/* Process-wide counters, updated lock-free from any thread. */
typedef struct Stats {
        atomic_uint_fast64_t bytes_read, bytes_written;          /* through the FUSE files */
        atomic_uint_fast64_t chunks_read, chunks_written;        /* chunk pieces touched by reads / writes */
        atomic_uint_fast64_t hits[_STATS_TIER_MAX];
        atomic_uint_fast64_t misses;                             /* accesses not satisfied from RAM */
        atomic_uint_fast64_t fetches, fetch_bytes, fetch_retries, fetch_bad;
        atomic_uint_fast64_t latency[STATS_LATENCY_BUCKETS];     /* server fetch latency */
        atomic_uint_fast64_t demand_latency[STATS_LATENCY_BUCKETS];   /* of those, the demand requests */
        atomic_uint_fast64_t quarantined;                        /* cache entries that failed verification */
        atomic_uint_fast64_t lookaside_bad;                      /* lookaside objects that failed verification */
        atomic_uint_fast64_t flushes, chunks_flushed;
        atomic_uint_fast64_t partial_chunks;                     /* written without fetching their object first */
        atomic_uint_fast64_t uploads, upload_bytes;
        atomic_uint_fast64_t errors;                             /* definitive read failures returned as EIO */
} Stats;

const char *stats_tier_name(StatsTier tier);

/* The upper bound of a latency bucket in microseconds (UINT64_MAX for the last). */
uint64_t stats_latency_bound(size_t bucket);

/* A fetch took usec from request to verified object; `demand`: a guest waited for it. */
void stats_add_latency(Stats *s, uint64_t usec, bool demand);

static inline void stats_add(atomic_uint_fast64_t *counter, uint64_t n) {
        atomic_fetch_add_explicit(counter, n, memory_order_relaxed);
}

static inline uint64_t stats_get(atomic_uint_fast64_t *counter) {
        return atomic_load_explicit(counter, memory_order_relaxed);
}

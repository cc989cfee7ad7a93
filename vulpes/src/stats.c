/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Live statistics: plain atomic counters that every module bumps without a lock.  They are read (not
 * reset) by the status report (daemon.c), which serves them through the `stats` file and the control
 * socket.
 *
 * Threading: every function is safe from any thread.
 */
#include "stats.h"

static const char *const tier_names[_STATS_TIER_MAX] = {
        [STATS_TIER_RAM] = "ram",
        [STATS_TIER_CACHE] = "cache",
        [STATS_TIER_LOOKASIDE] = "lookaside",
        [STATS_TIER_SERVER] = "server",
        [STATS_TIER_ZERO] = "zero",
        [STATS_TIER_NEW] = "new",
        [STATS_TIER_PACK] = "pack",
};

/* Roughly logarithmic, so that both a local hit (sub-millisecond) and an outage (seconds) are visible. */
static const uint64_t latency_bounds[STATS_LATENCY_BUCKETS - 1] = {
        500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000, 1000000, 2000000, 5000000,
};

const char *stats_tier_name(StatsTier tier) {
        return tier >= 0 && tier < _STATS_TIER_MAX ? tier_names[tier] : "?";
}

uint64_t stats_latency_bound(size_t bucket) {
        return bucket < STATS_LATENCY_BUCKETS - 1 ? latency_bounds[bucket] : UINT64_MAX;
}

void stats_add_latency(Stats *s, uint64_t usec, bool demand) {
        size_t i = 0;

        while (i < STATS_LATENCY_BUCKETS - 1 && usec > latency_bounds[i])
                i++;
        stats_add(&s->latency[i], 1);
        if (demand)
                stats_add(&s->demand_latency[i], 1);
}

/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "fetch.h"
#include "image.h"
#include "stats.h"

typedef struct Hoard Hoard;

/* What to hoard of one image: a list of chunk indices in priority order, then (with all) everything else. */
typedef struct HoardTarget {
        bool all;
        uint64_t *indices;             /* owned by the caller; copied by hoard_start() */
        size_t n;
} HoardTarget;

typedef enum HoardState {
        HOARD_IDLE,
        HOARD_RUNNING,
        HOARD_DONE,
        HOARD_STOPPED,
} HoardState;

typedef struct HoardProgress {
        HoardState state;
        uint64_t chunks_total, chunks_done, chunks_failed;
        uint64_t chunks_unstored;           /* fetched, but the cache had no room for them */
        bool cache_full;                    /* the hoard ended early: the cache has no room for the rest */
        uint64_t bytes_total, bytes_done;   /* plaintext bytes of the chunks */
        uint64_t bytes_fetched;             /* object bytes downloaded by this run */
        double seconds;                     /* since this run started */
        uint64_t evictions_at_done;         /* the cache's eviction count when it finished */
        FetchPriority priority;             /* of this run's requests: FETCH_HOARD or FETCH_IDLE */
} HoardProgress;

const char *hoard_state_name(HoardState state);

/*
 * The hoarder of a set of images.  state_path remembers a running request, so that a restarted daemon
 * continues it (hoard_resume()); chunks already in the cache are skipped, so a restart costs nothing.
 * A hoard never evicts what it stored or found in the cache itself (cache_put_keep()): when the cache has
 * no room left for its next object it ends early, done with cache_full, counting exactly what is there.
 */
int hoard_new(Image *const *images, size_t n_images, Cache *cache, Fetcher *fetcher, const char *state_path,
              unsigned window, Hoard **ret);

/*
 * Shutting down: hoard_halt() stops the worker without forgetting the request (the next start continues
 * it); then the fetcher is freed (which completes every request in flight); then hoard_free().
 */
void hoard_halt(Hoard *h);
Hoard *hoard_free(Hoard *h);

/* Starts hoarding targets[i] of images[i] (replacing a running request); parallel, below demand, at
 * priority FETCH_HOARD or FETCH_IDLE (only while no guest waits: fetch.c). */
int hoard_start(Hoard *h, const HoardTarget *targets, FetchPriority priority);

/* Continues a remembered request, if there is one: 1 if it did, 0 if there was none. */
int hoard_resume(Hoard *h);

/* Stops the running request and forgets it. */
void hoard_stop(Hoard *h);

void hoard_progress(Hoard *h, HoardProgress *ret);

/* Waits until the running request has finished (or was stopped); for tests and the control socket. */
void hoard_wait(Hoard *h);

/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Loading the resume pack's later parts (see packload.h).  Every part is queued at once: the fetcher starts
 * them in order as its pace allows, and a stop drops the ones that have not started.  The loading ends (no
 * read waits for a part any more: image_preload_end()) when every part has completed one way or another, or
 * at the first failure.
 */
#define _GNU_SOURCE
#include "packload.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "crypto.h"
#include "log.h"

enum {
        PACE_PARTS = 16,                /* the pace for a stop: over the last this many parts */
};

typedef struct PartRef {
        PackLoad *load;
        size_t index;                   /* into parts */
} PartRef;

struct PackLoad {
        Fetcher *fetcher;
        uint8_t key[SEAL_PARCEL_KEY_LEN];

        pthread_mutex_t lock;
        Image *img;
        PackPart *parts;
        PartRef *refs;
        size_t n, finished;             /* finished: parts completed, loaded or not */
        unsigned loaded;
        uint64_t keep, used, opened, rest;   /* rest: payload bytes of the parts not completed */
        /* (time, opened) when each of the last PACE_PARTS parts was loaded, a ring; at first the start's. */
        uint64_t mark_us[PACE_PARTS], mark_opened[PACE_PARTS];
        unsigned next_mark;
        double seconds;
        uint64_t started_us, ended_us;
        bool started, ended, stopped, failed;
};

static uint64_t now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t) ts.tv_sec * 1000000u + (uint64_t) ts.tv_nsec / 1000u;
}

bool packload_should_stop(uint64_t used, uint64_t keep, uint64_t rest, uint64_t opened, uint64_t elapsed_us,
                          double seconds) {
        double pace;

        if (used < keep || rest == 0)
                return false;
        pace = (double) opened * 1e6 / (double) (elapsed_us > 1000 ? elapsed_us : 1000);
        return (double) rest > pace * seconds;
}

int packload_new(Fetcher *fetcher, const uint8_t parcel_key[SEAL_PARCEL_KEY_LEN], PackLoad **ret) {
        PackLoad *l = calloc(1, sizeof(*l));

        if (!l)
                return -ENOMEM;
        l->fetcher = fetcher;
        memcpy(l->key, parcel_key, SEAL_PARCEL_KEY_LEN);
        pthread_mutex_init(&l->lock, NULL);
        *ret = l;
        return 0;
}

static void parts_free(PackPart *parts, size_t n) {
        for (size_t i = 0; parts && i < n; i++)
                free(parts[i].path);
        free(parts);
}

PackLoad *packload_free(PackLoad *l) {
        if (!l)
                return NULL;
        parts_free(l->parts, l->n);
        free(l->refs);
        crypto_wipe(l->key, sizeof(l->key));
        pthread_mutex_destroy(&l->lock);
        free(l);
        return NULL;
}

/* With the lock held: the loading is over, reads stop waiting for parts. */
static void end_locked(PackLoad *l) {
        if (l->ended)
                return;
        l->ended = true;
        l->ended_us = now_us();
        image_preload_end(l->img);
        log_info("%s: resume pack: %u of %zu later parts loaded (%llu bytes) in %.2f s%s", image_name(l->img),
                 l->loaded, l->n, (unsigned long long) l->used, (double) (l->ended_us - l->started_us) / 1e6,
                 l->stopped ? ", the rest not fetched" : l->failed ? ", the rest not used" : "");
}

/* Opens a part's object and checks it against the manifest's figures; the payload is malloc()ed. */
static int part_open(PackLoad *l, const PackPart *p, const uint8_t *object, size_t len, uint8_t **ret_payload,
                     size_t *ret_len) {
        uint8_t digest[CRYPTO_SHA256_LEN];
        int r;

        r = seal_open(l->key, object, len, SEAL_KIND_DEVICE_STATE, p->size, ret_payload, ret_len);
        if (r < 0)
                return r;
        r = crypto_sha256(*ret_payload, *ret_len, digest);
        if (r == 0 && (*ret_len != p->size || memcmp(digest, p->sha256, sizeof(digest)) != 0))
                r = -EBADMSG;
        if (r < 0) {
                crypto_wipe(*ret_payload, *ret_len);
                free(*ret_payload);
                *ret_payload = NULL;
        }
        return r;
}

static const char *failure(int r) {
        switch (r) {
        case -ENOENT:
                return "the server does not have it";
        case -EBADMSG:
                return "it does not open with the parcel key or does not match the manifest";
        default:
                return strerror(-r);
        }
}

static void on_part(int result, const uint8_t *object, size_t len, void *userdata) {
        PartRef *ref = userdata;
        PackLoad *l = ref->load;
        const PackPart *p = &l->parts[ref->index];
        uint8_t *payload = NULL;
        size_t payload_len = 0;
        bool drop = false;
        int r = result;

        if (r == 0)
                r = part_open(l, p, object, len, &payload, &payload_len);
        pthread_mutex_lock(&l->lock);
        if (r == 0 && !l->failed) {
                r = image_preload(l->img, payload, payload_len, p->index);
                if (r >= 0) {
                        payload = NULL;         /* the image's now */
                        l->used += (uint64_t) r;
                        l->opened += payload_len;
                        l->mark_us[l->next_mark] = now_us();
                        l->mark_opened[l->next_mark] = l->opened;
                        l->next_mark = (l->next_mark + 1) % PACE_PARTS;
                        l->loaded++;
                        r = 0;
                }
        }
        l->finished++;
        l->rest -= p->size;
        if (r < 0 && r != -ECANCELED && !l->failed && !l->ended) {
                log_warning("%s: the resume pack is not used from part %u on: %s", image_name(l->img), p->index,
                            failure(r));
                l->failed = drop = true;
        }
        if (r == 0 && !l->stopped && !l->failed &&
            packload_should_stop(l->used, l->keep, l->rest, l->opened - l->mark_opened[l->next_mark],
                                 now_us() - l->mark_us[l->next_mark], l->seconds)) {
                log_info("%s: resume pack: its last %llu bytes of payload are not fetched: at the pace of the others "
                         "they would take more than %.1f s", image_name(l->img), (unsigned long long) l->rest,
                         l->seconds);
                l->stopped = drop = true;
        }
        if (l->failed || l->finished == l->n)
                end_locked(l);
        pthread_mutex_unlock(&l->lock);
        if (payload) {
                crypto_wipe(payload, payload_len);
                free(payload);
        }
        if (drop)
                fetch_drop_queued(l->fetcher, FETCH_PACK);     /* their callbacks come here, -ECANCELED */
}

int packload_start(PackLoad *l, Image *img, PackPart *parts, size_t n, uint64_t keep, double seconds) {
        PartRef *refs = calloc(n ? n : 1, sizeof(*refs));
        uint64_t rest = 0;

        pthread_mutex_lock(&l->lock);
        if (l->started || !refs) {
                pthread_mutex_unlock(&l->lock);
                free(refs);
                return refs ? -EBUSY : -ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
                refs[i] = (PartRef) { .load = l, .index = i };
                rest += parts[i].size;
        }
        l->img = img;
        l->parts = parts;
        l->refs = refs;
        l->n = n;
        l->keep = keep;
        l->rest = rest;
        l->seconds = seconds;
        l->started_us = now_us();
        for (unsigned i = 0; i < PACE_PARTS; i++)
                l->mark_us[i] = l->started_us;
        l->started = true;
        if (n == 0)
                end_locked(l);
        pthread_mutex_unlock(&l->lock);

        /* Parts may complete (and stop the loading) while later ones are still being queued: dropped, those
         * complete too, so every part completes once. */
        for (size_t i = 0; i < n; i++) {
                int r = fetch_get_blob(l->fetcher, parts[i].path, parts[i].size + SEAL_OVERHEAD, parts[i].size,
                                       FETCH_PACK, on_part, &refs[i]);

                if (r < 0)
                        on_part(r, NULL, 0, &refs[i]);
        }
        return 0;
}

void packload_progress(PackLoad *l, PackLoadProgress *ret) {
        pthread_mutex_lock(&l->lock);
        *ret = (PackLoadProgress) {
                .started = l->started, .ended = l->ended, .stopped = l->stopped, .failed = l->failed,
                .parts = (unsigned) l->n, .loaded = l->loaded, .bytes = l->used,
                .seconds = l->started ? (double) ((l->ended ? l->ended_us : now_us()) - l->started_us) / 1e6 : 0,
        };
        pthread_mutex_unlock(&l->lock);
}

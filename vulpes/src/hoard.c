/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Hoarding: fetching a parcel's chunks into the persistent cache ahead of need.  Unlike OpenISR's
 * one-GET-at-a-time hoard, a window of requests is kept in flight at hoard priority, so the link stays
 * full while a guest read still overtakes every queued hoard request (fetch.c).
 *
 * A request (everything, or chunk lists in priority order) is remembered in a small text file and
 * removed when it completes or is stopped; a daemon that restarts continues it, and chunks already in the
 * cache cost one stat() each.  Transient network trouble never fails a hoard: fetch.c retries forever.
 *
 * Threading: one worker thread per request; the public functions are safe from any thread.  Completion
 * callbacks run on the fetch thread.
 */
#define _GNU_SOURCE
#include "hoard.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "chunk.h"
#include "file.h"
#include "hex.h"
#include "log.h"

typedef struct Target {
        bool all;
        uint64_t *indices;
        size_t n;
} Target;

struct Hoard {
        Image **images;
        size_t n_images;
        Cache *cache;
        Fetcher *fetcher;
        char *state_path;
        unsigned window;
        FetchPriority priority;

        pthread_mutex_t lock;
        pthread_cond_t cond;
        Target *targets;                  /* the running request, one per image */
        bool thread_running, stop;
        pthread_t thread;
        unsigned outstanding;
        HoardProgress progress;
        struct timespec started;
        int64_t keep_since;               /* the run's start in the cache's clock: what it may not evict */
};

typedef struct Pending {
        Hoard *hoard;
        uint8_t tag[IMAGE_TAG_LEN];
        size_t plain_len;
} Pending;

const char *hoard_state_name(HoardState state) {
        static const char *const names[] = { "idle", "running", "done", "stopped" };

        return state <= HOARD_STOPPED ? names[state] : "?";
}

static void targets_free(Target *targets, size_t n) {
        if (!targets)
                return;
        for (size_t i = 0; i < n; i++)
                free(targets[i].indices);
        free(targets);
}

/* --- remembering the request ------------------------------------------------------------------------ */

/* One line per image: "<name> all" or "<name> <idx> <idx> ..." (or both: the list first); "priority idle"
 * for an idle request. */
static int state_save(Hoard *h) {
        char *text = NULL;
        size_t len = 0;
        FILE *f;
        int r;

        f = open_memstream(&text, &len);
        if (!f)
                return -ENOMEM;
        if (h->priority == FETCH_IDLE)
                fputs("priority idle\n", f);
        for (size_t i = 0; i < h->n_images; i++) {
                fprintf(f, "%s", image_name(h->images[i]));
                if (h->targets[i].all)
                        fprintf(f, " all");
                for (size_t j = 0; j < h->targets[i].n; j++)
                        fprintf(f, " %llu", (unsigned long long) h->targets[i].indices[j]);
                fputc('\n', f);
        }
        fclose(f);
        r = file_write_atomic(h->state_path, text, len, 0600);
        free(text);
        return r;
}

static int state_load(Hoard *h, Target **ret, FetchPriority *ret_priority) {
        uint8_t *data = NULL;
        size_t len = 0;
        Target *targets;
        char *save = NULL;
        int r = 0;

        if (access(h->state_path, F_OK) < 0)
                return 0;
        r = file_read_all(h->state_path, (size_t) 1 << 30, &data, &len);
        if (r < 0)
                return r;
        targets = calloc(h->n_images, sizeof(*targets));
        if (!targets) {
                free(data);
                return -ENOMEM;
        }
        for (char *line = strtok_r((char *) data, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
                char *word_save = NULL, *word = strtok_r(line, " ", &word_save);
                Target *t = NULL;

                if (word && strcmp(word, "priority") == 0) {
                        word = strtok_r(NULL, " ", &word_save);
                        *ret_priority = word && strcmp(word, "idle") == 0 ? FETCH_IDLE : FETCH_HOARD;
                        continue;
                }
                for (size_t i = 0; word && i < h->n_images; i++)
                        if (strcmp(word, image_name(h->images[i])) == 0)
                                t = &targets[i];
                if (!t)
                        continue;
                while ((word = strtok_r(NULL, " ", &word_save))) {
                        char *end;
                        unsigned long long idx;

                        if (strcmp(word, "all") == 0) {
                                t->all = true;
                                continue;
                        }
                        idx = strtoull(word, &end, 10);
                        if (*end)
                                continue;
                        uint64_t *p = realloc(t->indices, (t->n + 1) * sizeof(*p));

                        if (!p) {
                                r = -ENOMEM;
                                break;
                        }
                        t->indices = p;
                        t->indices[t->n++] = idx;
                }
        }
        free(data);
        if (r < 0) {
                targets_free(targets, h->n_images);
                return r;
        }
        *ret = targets;
        return 1;
}

/* --- the worker ------------------------------------------------------------------------------------- */

static void on_fetched(int result, const uint8_t *object, size_t len, void *userdata) {
        Pending *p = userdata;
        Hoard *h = p->hoard;
        int stored = 0;

        if (result == 0)
                stored = cache_put_keep(h->cache, p->tag, object, len, h->keep_since);
        if (result == 0 && stored < 0 && stored != -ENOSPC && stored != -EDQUOT) {
                char hex[IMAGE_TAG_LEN * 2 + 1];

                hex_encode(p->tag, IMAGE_TAG_LEN, hex);
                log_warning("failed to hoard chunk %s: cannot store it in the cache: %s", hex, strerror(-stored));
        } else if (result != 0 && result != -ECANCELED) {
                char hex[IMAGE_TAG_LEN * 2 + 1];

                hex_encode(p->tag, IMAGE_TAG_LEN, hex);
                log_warning("failed to hoard chunk %s: %s", hex,
                            result == -ENOENT ? "the server does not have it" : "every copy failed verification");
        }
        pthread_mutex_lock(&h->lock);
        if (result == 0)
                h->progress.bytes_fetched += len;
        if (result == 0 && stored >= 0) {
                h->progress.chunks_done++;
                h->progress.bytes_done += p->plain_len;
        } else if (result == 0 && (stored == -ENOSPC || stored == -EDQUOT)) {
                /* No more room that this hoard may make: it stops asking for more. */
                h->progress.chunks_unstored++;
                h->progress.cache_full = true;
        } else {
                h->progress.chunks_failed++;
        }
        h->outstanding--;
        pthread_cond_broadcast(&h->cond);
        pthread_mutex_unlock(&h->lock);
        free(p);
}

static int hoard_one(Hoard *h, Image *img, uint64_t idx) {
        uint8_t tag[IMAGE_TAG_LEN];
        size_t plain_len = chunk_length(image_size(img), image_chunk_size(img), idx);
        Pending *p;
        int r;

        if (image_chunk_tag(img, idx, tag) < 0)
                return 0;           /* all zeros: nothing to fetch, not counted */
        if (cache_has(h->cache, tag)) {
                /* Kept: a used object is one this hoard does not evict to make room for the rest. */
                cache_touch(h->cache, tag);
                pthread_mutex_lock(&h->lock);
                h->progress.chunks_done++;
                h->progress.bytes_done += plain_len;
                pthread_mutex_unlock(&h->lock);
                return 0;
        }
        p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->hoard = h;
        memcpy(p->tag, tag, IMAGE_TAG_LEN);
        p->plain_len = plain_len;

        pthread_mutex_lock(&h->lock);
        while (h->outstanding >= h->window && !h->stop && !h->progress.cache_full)
                pthread_cond_wait(&h->cond, &h->lock);
        if (h->stop || h->progress.cache_full) {
                /* A full cache ends the fetching, not the walk: the chunks after this one that are in the cache
                 * are counted all the same (the status says how many are really here). */
                r = h->stop ? -ECANCELED : 0;
                pthread_mutex_unlock(&h->lock);
                free(p);
                return r;
        }
        h->outstanding++;
        pthread_mutex_unlock(&h->lock);
        r = fetch_get(h->fetcher, tag, h->priority, on_fetched, p);
        if (r < 0) {
                pthread_mutex_lock(&h->lock);
                h->outstanding--;
                pthread_mutex_unlock(&h->lock);
                free(p);
        }
        return r;
}

/* The order images are hoarded in: memory first, because a resumed guest touches its RAM before anything
 * else, and every RAM chunk still missing then is a round trip it waits for. */
static size_t hoard_image_at(const Hoard *h, size_t k) {
        size_t memory = h->n_images;

        for (size_t i = 0; i < h->n_images; i++)
                if (strcmp(image_name(h->images[i]), "memory") == 0)
                        memory = i;
        if (memory == h->n_images)
                return k;
        if (k == 0)
                return memory;
        return k <= memory ? k - 1 : k;
}

static void *hoard_thread(void *userdata) {
        Hoard *h = userdata;
        int r = 0;

        for (size_t k = 0; k < h->n_images && r >= 0; k++) {
                size_t i = hoard_image_at(h, k);
                Target *t = &h->targets[i];
                Image *img = h->images[i];

                uint8_t *listed = NULL;

                for (size_t j = 0; j < t->n && r >= 0; j++)
                        if (t->indices[j] < image_chunk_count(img))
                                r = hoard_one(h, img, t->indices[j]);
                if (t->all && t->n) {
                        /* The rest after the list: what the list had is done (and counted) already. */
                        listed = calloc(image_chunk_count(img) / 8 + 1, 1);
                        if (!listed)
                                r = -ENOMEM;
                        for (size_t j = 0; listed && j < t->n; j++)
                                if (t->indices[j] < image_chunk_count(img))
                                        listed[t->indices[j] / 8] |= (uint8_t) (1u << (t->indices[j] % 8));
                }
                if (t->all)
                        for (uint64_t idx = 0; idx < image_chunk_count(img) && r >= 0; idx++)
                                if (!listed || !(listed[idx / 8] & (1u << (idx % 8))))
                                        r = hoard_one(h, img, idx);
                free(listed);
        }
        pthread_mutex_lock(&h->lock);
        /* A stop does not wait for requests in flight (the server may be unreachable); their callbacks
         * only count, and the Hoard outlives the fetcher that calls them. */
        while (h->outstanding > 0 && !h->stop)
                pthread_cond_wait(&h->cond, &h->lock);
        if (!h->stop) {
                h->progress.state = HOARD_DONE;
                h->progress.evictions_at_done = cache_evictions_total(h->cache);
                unlink(h->state_path);
                if (h->progress.cache_full)
                        log_warning("failed to hoard everything: the cache has no room left; %llu of %llu chunks "
                                    "are in the cache", (unsigned long long) h->progress.chunks_done,
                                    (unsigned long long) h->progress.chunks_total);
                else
                        log_info("hoard finished: %llu chunks, %llu failed, %llu bytes fetched",
                                 (unsigned long long) h->progress.chunks_done,
                                 (unsigned long long) h->progress.chunks_failed,
                                 (unsigned long long) h->progress.bytes_fetched);
        }
        pthread_cond_broadcast(&h->cond);
        pthread_mutex_unlock(&h->lock);
        return NULL;
}

/* Totals, counted up front so that progress has a denominator; duplicates in a list count once each, and a
 * list followed by everything else counts everything once. */
static void totals(Hoard *h, Target *targets, uint64_t *ret_chunks, uint64_t *ret_bytes) {
        uint8_t tag[IMAGE_TAG_LEN];

        *ret_chunks = *ret_bytes = 0;
        for (size_t i = 0; i < h->n_images; i++) {
                Image *img = h->images[i];

                for (size_t j = 0; j < targets[i].n && !targets[i].all; j++)
                        if (targets[i].indices[j] < image_chunk_count(img) &&
                            image_chunk_tag(img, targets[i].indices[j], tag) == 0) {
                                (*ret_chunks)++;
                                *ret_bytes += chunk_length(image_size(img), image_chunk_size(img),
                                                           targets[i].indices[j]);
                        }
                if (targets[i].all)
                        for (uint64_t idx = 0; idx < image_chunk_count(img); idx++)
                                if (image_chunk_tag(img, idx, tag) == 0) {
                                        (*ret_chunks)++;
                                        *ret_bytes += chunk_length(image_size(img), image_chunk_size(img), idx);
                                }
        }
}

static void join_locked(Hoard *h) {
        if (!h->thread_running)
                return;
        h->stop = true;
        pthread_cond_broadcast(&h->cond);
        pthread_mutex_unlock(&h->lock);
        pthread_join(h->thread, NULL);
        pthread_mutex_lock(&h->lock);
        h->thread_running = false;
        h->stop = false;
}

/* Takes ownership of targets. */
static int run(Hoard *h, Target *targets, FetchPriority priority) {
        uint64_t chunks, bytes;
        int r;

        pthread_mutex_lock(&h->lock);
        join_locked(h);
        h->priority = priority;
        targets_free(h->targets, h->n_images);
        h->targets = targets;
        totals(h, targets, &chunks, &bytes);
        memset(&h->progress, 0, sizeof(h->progress));
        h->progress.state = HOARD_RUNNING;
        h->progress.chunks_total = chunks;
        h->progress.bytes_total = bytes;
        clock_gettime(CLOCK_MONOTONIC, &h->started);
        h->keep_since = cache_now_us();
        r = state_save(h);
        if (r < 0) {
                h->progress.state = HOARD_IDLE;
                pthread_mutex_unlock(&h->lock);
                return r;
        }
        r = -pthread_create(&h->thread, NULL, hoard_thread, h);
        if (r == 0)
                h->thread_running = true;
        pthread_mutex_unlock(&h->lock);
        return r;
}

int hoard_start(Hoard *h, const HoardTarget *requested, FetchPriority priority) {
        Target *targets = calloc(h->n_images, sizeof(*targets));

        if (!targets)
                return -ENOMEM;
        for (size_t i = 0; i < h->n_images; i++) {
                targets[i].all = requested[i].all;
                if (requested[i].n == 0)
                        continue;
                targets[i].indices = malloc(requested[i].n * sizeof(uint64_t));
                if (!targets[i].indices) {
                        targets_free(targets, h->n_images);
                        return -ENOMEM;
                }
                memcpy(targets[i].indices, requested[i].indices, requested[i].n * sizeof(uint64_t));
                targets[i].n = requested[i].n;
        }
        return run(h, targets, priority);
}

int hoard_resume(Hoard *h) {
        FetchPriority priority = FETCH_HOARD;
        Target *targets = NULL;
        int r;

        r = state_load(h, &targets, &priority);
        if (r <= 0)
                return r;
        log_info("continuing the hoard request in %s", h->state_path);
        r = run(h, targets, priority);
        return r < 0 ? r : 1;
}

void hoard_stop(Hoard *h) {
        pthread_mutex_lock(&h->lock);
        if (h->thread_running) {
                join_locked(h);
                if (h->progress.state == HOARD_RUNNING)
                        h->progress.state = HOARD_STOPPED;
        }
        unlink(h->state_path);
        pthread_mutex_unlock(&h->lock);
}

void hoard_wait(Hoard *h) {
        pthread_mutex_lock(&h->lock);
        while (h->progress.state == HOARD_RUNNING)
                pthread_cond_wait(&h->cond, &h->lock);
        pthread_mutex_unlock(&h->lock);
}

void hoard_progress(Hoard *h, HoardProgress *ret) {
        struct timespec now;

        pthread_mutex_lock(&h->lock);
        *ret = h->progress;
        ret->priority = h->priority;
        if (ret->state != HOARD_IDLE) {
                clock_gettime(CLOCK_MONOTONIC, &now);
                ret->seconds = (double) (now.tv_sec - h->started.tv_sec) +
                               (double) (now.tv_nsec - h->started.tv_nsec) / 1e9;
        }
        pthread_mutex_unlock(&h->lock);
}

int hoard_new(Image *const *images, size_t n_images, Cache *cache, Fetcher *fetcher, const char *state_path,
              unsigned window, Hoard **ret) {
        Hoard *h = calloc(1, sizeof(*h));

        if (!h)
                return -ENOMEM;
        pthread_mutex_init(&h->lock, NULL);
        pthread_cond_init(&h->cond, NULL);
        h->images = calloc(n_images, sizeof(*h->images));
        h->state_path = strdup(state_path);
        if (!h->images || !h->state_path) {
                hoard_free(h);
                return -ENOMEM;
        }
        memcpy(h->images, images, n_images * sizeof(*images));
        h->n_images = n_images;
        h->cache = cache;
        h->fetcher = fetcher;
        h->window = window ? window : 64;
        h->priority = FETCH_HOARD;
        *ret = h;
        return 0;
}

void hoard_halt(Hoard *h) {
        pthread_mutex_lock(&h->lock);
        join_locked(h);
        pthread_mutex_unlock(&h->lock);
}

Hoard *hoard_free(Hoard *h) {
        if (!h)
                return NULL;
        pthread_mutex_lock(&h->lock);
        join_locked(h);
        /* The fetcher is gone by now (daemon.c frees it first), so every callback has run. */
        pthread_mutex_unlock(&h->lock);
        targets_free(h->targets, h->n_images);
        free(h->images);
        free(h->state_path);
        pthread_cond_destroy(&h->cond);
        pthread_mutex_destroy(&h->lock);
        free(h);
        return NULL;
}

/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Writeback: uploading the chunk objects that flushes created (the keyring's vulpes_uploads table) to the
 * server.  Trickle mode does it while the VM runs, one object at a time under a bandwidth cap, so that a
 * suspend has little left to send (OpenISR uploaded only at checkin); upload_all does the rest at full
 * speed with several transfers in flight.  Objects are read from the cache and verified before they
 * are sent; one that is lost or damaged there is reported and dropped from the list (it exists nowhere
 * else, and the server will refuse to commit a version that names it).
 *
 * A full-speed pass lists every pending upload at once and keeps the fetcher's upload queue full until
 * the list is done (it used to take 64 at a time and let the pipeline run dry between them).  Confirmed
 * uploads are not forgotten on the fetch thread one durable sqlite commit at a time: the completion
 * callback only queues them, and the worker forgets whatever has queued up in one transaction per image
 * (a group commit: under load the batches grow by themselves).  Forgetting late is harmless: an upload
 * still listed after a crash is sent again and the server answers that it has it.
 *
 * Threading: one worker thread; the public functions are safe from any thread.
 */
#define _GNU_SOURCE
#include "writeback.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hex.h"
#include "log.h"

enum {
        UPLOAD_BATCH = 64,              /* trickle passes: tags listed at a time */
        PARALLEL_FULL = 64,             /* full speed: handed to the fetcher at once (it runs up to 32) */
        IDLE_POLL_MS = 1000,
};

typedef struct Upload Upload;

struct Writeback {
        Image **images;
        size_t n_images;
        Cache *cache;
        Fetcher *fetcher;

        pthread_mutex_t lock;
        pthread_cond_t cond;
        bool trickle;
        uint64_t rate;
        unsigned full_waiters;
        uint64_t passes_started, clean_pass;   /* the last pass that found nothing to upload */
        bool uploading, stop, thread_started;
        unsigned in_flight;
        uint64_t uploaded_chunks, uploaded_bytes, failed, this_pass;
        Upload *done;                   /* confirmed by the server, not yet forgotten in the keyring */
        pthread_t thread;
};

struct Upload {
        Writeback *w;
        Image *img;
        uint8_t tag[IMAGE_TAG_LEN];
        size_t len;
        Upload *next;
};

static void timed_wait(pthread_cond_t *cond, pthread_mutex_t *lock, unsigned ms) {
        struct timespec t;

        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_sec += ms / 1000;
        t.tv_nsec += (long) (ms % 1000) * 1000000L;
        if (t.tv_nsec >= 1000000000L) {
                t.tv_sec++;
                t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(cond, lock, &t);
}

/* Forgets the queued confirmed uploads: one keyring transaction (and one unpin) per image.  Called
 * without the lock, by the worker (or by writeback_free() once nothing runs any more). */
static void done_apply(Writeback *w) {
        uint8_t (*tags)[IMAGE_TAG_LEN] = NULL;
        Upload *list, *u;
        size_t max = 0;

        pthread_mutex_lock(&w->lock);
        list = w->done;
        w->done = NULL;
        pthread_mutex_unlock(&w->lock);
        for (u = list; u; u = u->next)
                max++;
        if (max > 0)
                tags = malloc(max * sizeof(*tags));
        for (size_t i = 0; i < w->n_images && list; i++) {
                size_t n = 0;

                for (u = list; u; u = u->next) {
                        if (u->img != w->images[i])
                                continue;
                        if (tags)
                                memcpy(tags[n++], u->tag, IMAGE_TAG_LEN);
                        else
                                image_uploads_done(u->img, (const uint8_t (*)[IMAGE_TAG_LEN]) u->tag, 1);
                }
                if (n > 0)
                        image_uploads_done(w->images[i], (const uint8_t (*)[IMAGE_TAG_LEN]) tags, n);
        }
        free(tags);
        while (list) {
                u = list->next;
                free(list);
                list = u;
        }
}

static void on_uploaded(int result, const uint8_t *object, size_t len, void *userdata) {
        Upload *u = userdata;
        Writeback *w = u->w;

        (void) object;
        (void) len;
        pthread_mutex_lock(&w->lock);
        if (result == 0) {
                w->uploaded_chunks++;
                w->uploaded_bytes += u->len;
        } else if (result != -ECANCELED) {
                w->failed++;
        }
        /* A definitive refusal (logged by fetch.c) is not retried either: it would be refused again. */
        if (result != -ECANCELED) {
                u->next = w->done;
                w->done = u;
                u = NULL;
        }
        w->in_flight--;
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
        free(u);
}

/* Starts one upload, waiting for a free slot first; -ECANCELED when stopping. */
static int upload_start(Writeback *w, Image *img, const uint8_t tag[IMAGE_TAG_LEN]) {
        uint8_t *object = NULL;
        size_t len = 0;
        unsigned parallel;
        uint64_t rate;
        Upload *u;
        int r;

        r = cache_get(w->cache, tag, &object, &len);
        if (r < 0) {
                char hex[IMAGE_TAG_LEN * 2 + 1];

                hex_encode(tag, IMAGE_TAG_LEN, hex);
                log_error("failed to upload %s chunk object %s: %s in the cache, and it exists nowhere else",
                          image_name(img), hex, r == -ENOENT ? "it is missing" : "it failed verification");
                image_uploads_done(img, (const uint8_t (*)[IMAGE_TAG_LEN]) tag, 1);
                pthread_mutex_lock(&w->lock);
                w->failed++;
                pthread_mutex_unlock(&w->lock);
                return 0;
        }
        u = calloc(1, sizeof(*u));
        if (!u) {
                free(object);
                return -ENOMEM;
        }
        u->w = w;
        u->img = img;
        u->len = len;
        memcpy(u->tag, tag, IMAGE_TAG_LEN);

        pthread_mutex_lock(&w->lock);
        for (;;) {
                bool full = w->full_waiters > 0;

                parallel = full ? PARALLEL_FULL : 1;
                rate = full ? 0 : w->rate;
                if (w->stop || w->in_flight < parallel)
                        break;
                if (w->done) {
                        pthread_mutex_unlock(&w->lock);
                        done_apply(w);
                        pthread_mutex_lock(&w->lock);
                        continue;
                }
                pthread_cond_wait(&w->cond, &w->lock);
        }
        if (w->stop) {
                pthread_mutex_unlock(&w->lock);
                free(object);
                free(u);
                return -ECANCELED;
        }
        w->in_flight++;
        pthread_mutex_unlock(&w->lock);
        r = fetch_put(w->fetcher, tag, object, len, rate, on_uploaded, u);
        free(object);
        if (r < 0) {
                pthread_mutex_lock(&w->lock);
                w->in_flight--;
                pthread_mutex_unlock(&w->lock);
                free(u);
        }
        return r;
}

/* One pass over every image's upload list (all of it at full speed, UPLOAD_BATCH tags when trickling);
 * returns how many uploads it started. */
static int64_t upload_pass(Writeback *w) {
        int64_t total = 0;
        bool full;
        int r = 0;

        done_apply(w);
        pthread_mutex_lock(&w->lock);
        full = w->full_waiters > 0;
        pthread_mutex_unlock(&w->lock);
        for (size_t i = 0; i < w->n_images && r >= 0; i++) {
                uint8_t (*tags)[IMAGE_TAG_LEN] = NULL;
                size_t n = 0;

                if (full) {
                        r = image_pending_uploads(w->images[i], &tags, &n);
                } else {
                        tags = malloc(UPLOAD_BATCH * sizeof(*tags));
                        r = tags ? image_uploads_next(w->images[i], tags, UPLOAD_BATCH, &n) : -ENOMEM;
                }
                for (size_t j = 0; j < n && r >= 0; j++)
                        r = upload_start(w, w->images[i], tags[j]);
                free(tags);
                total += (int64_t) n;
        }
        /* Let this pass's uploads finish, so that the next pass does not list them again. */
        pthread_mutex_lock(&w->lock);
        while (w->in_flight > 0 && !w->stop)
                pthread_cond_wait(&w->cond, &w->lock);
        pthread_mutex_unlock(&w->lock);
        done_apply(w);
        return r < 0 ? r : total;
}

static void *writeback_thread(void *userdata) {
        Writeback *w = userdata;

        pthread_mutex_lock(&w->lock);
        while (!w->stop) {
                uint64_t pass;
                int64_t n;

                if (!w->trickle && w->full_waiters == 0) {
                        timed_wait(&w->cond, &w->lock, IDLE_POLL_MS);
                        continue;
                }
                pass = ++w->passes_started;
                w->uploading = true;
                pthread_mutex_unlock(&w->lock);
                n = upload_pass(w);
                pthread_mutex_lock(&w->lock);
                w->uploading = false;
                if (n == 0) {
                        w->clean_pass = pass;
                        pthread_cond_broadcast(&w->cond);
                        if (w->full_waiters == 0)
                                timed_wait(&w->cond, &w->lock, IDLE_POLL_MS);
                } else if (n < 0 && !w->stop) {
                        timed_wait(&w->cond, &w->lock, IDLE_POLL_MS);
                }
        }
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
        return NULL;
}

int writeback_new(Image *const *images, size_t n_images, Cache *cache, Fetcher *fetcher, Writeback **ret) {
        Writeback *w = calloc(1, sizeof(*w));
        int r;

        if (!w)
                return -ENOMEM;
        pthread_mutex_init(&w->lock, NULL);
        pthread_cond_init(&w->cond, NULL);
        w->images = calloc(n_images, sizeof(*w->images));
        if (!w->images) {
                writeback_free(w);
                return -ENOMEM;
        }
        memcpy(w->images, images, n_images * sizeof(*images));
        w->n_images = n_images;
        w->cache = cache;
        w->fetcher = fetcher;
        r = -pthread_create(&w->thread, NULL, writeback_thread, w);
        if (r < 0) {
                writeback_free(w);
                return r;
        }
        w->thread_started = true;
        *ret = w;
        return 0;
}

void writeback_halt(Writeback *w) {
        if (!w || !w->thread_started)
                return;
        pthread_mutex_lock(&w->lock);
        w->stop = true;
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
        pthread_join(w->thread, NULL);
        w->thread_started = false;
}

Writeback *writeback_free(Writeback *w) {
        if (!w)
                return NULL;
        writeback_halt(w);
        done_apply(w);
        free(w->images);
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->lock);
        free(w);
        return NULL;
}

void writeback_set_trickle(Writeback *w, bool enabled, uint64_t rate) {
        pthread_mutex_lock(&w->lock);
        w->trickle = enabled;
        w->rate = rate;
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
}

int64_t writeback_upload_all(Writeback *w) {
        uint64_t want, before;

        /* What a trickle has queued or in flight goes at full speed too, instead of holding this back. */
        fetch_set_full_speed(w->fetcher, true);
        pthread_mutex_lock(&w->lock);
        before = w->uploaded_chunks;
        w->full_waiters++;
        want = w->passes_started + 1;
        pthread_cond_broadcast(&w->cond);
        while (w->clean_pass < want && !w->stop)
                pthread_cond_wait(&w->cond, &w->lock);
        w->full_waiters--;
        before = w->uploaded_chunks - before;
        pthread_mutex_unlock(&w->lock);
        fetch_set_full_speed(w->fetcher, false);
        return w->stop ? -ECANCELED : (int64_t) before;
}

void writeback_status(Writeback *w, WritebackStatus *ret) {
        pthread_mutex_lock(&w->lock);
        ret->trickle = w->trickle;
        ret->rate = w->rate;
        ret->uploading = w->uploading;
        ret->uploaded_chunks = w->uploaded_chunks;
        ret->uploaded_bytes = w->uploaded_bytes;
        ret->failed = w->failed;
        pthread_mutex_unlock(&w->lock);
}

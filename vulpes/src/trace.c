/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Access traces: one text line per chunk access, for the working-set policy (which chunks a resumed
 * guest touches first) and for tools/chunksim.  Text, because traces are small next to the images and
 * every tool can read them.
 *
 * Threading: every function is safe from any thread; trace_record() costs one atomic load when no
 * trace runs.
 */
#define _GNU_SOURCE
#include "trace.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

struct Trace {
        atomic_bool active;
        pthread_mutex_t lock;
        FILE *file;
        char *path;
        uint64_t records;
};

int trace_new(Trace **ret) {
        Trace *t = calloc(1, sizeof(*t));

        if (!t)
                return -ENOMEM;
        pthread_mutex_init(&t->lock, NULL);
        *ret = t;
        return 0;
}

Trace *trace_free(Trace *t) {
        if (!t)
                return NULL;
        trace_stop(t);
        pthread_mutex_destroy(&t->lock);
        free(t);
        return NULL;
}

static uint64_t stop_locked(Trace *t) {
        uint64_t n = t->records;

        atomic_store(&t->active, false);
        if (t->file) {
                if (fclose(t->file) != 0)
                        log_error("failed to write trace %s: %s", t->path, strerror(errno));
                t->file = NULL;
        }
        free(t->path);
        t->path = NULL;
        t->records = 0;
        return n;
}

int trace_start(Trace *t, const char *path, const char *const images[], const uint32_t chunk_sizes[],
                size_t n_images) {
        FILE *f;
        char *copy;
        int r;

        copy = strdup(path);
        if (!copy)
                return -ENOMEM;
        f = fopen(path, "ae");
        if (!f) {
                r = -errno;
                log_error("failed to open trace %s: %s", path, strerror(-r));
                free(copy);
                return r;
        }
        fputs("# vulpes-trace 3", f);
        for (size_t i = 0; i < n_images; i++)
                fprintf(f, " %s.chunk_size=%u", images[i], chunk_sizes[i]);
        fputc('\n', f);
        pthread_mutex_lock(&t->lock);
        stop_locked(t);
        t->file = f;
        t->path = copy;
        atomic_store(&t->active, true);
        pthread_mutex_unlock(&t->lock);
        return 0;
}

uint64_t trace_stop(Trace *t) {
        uint64_t n;

        pthread_mutex_lock(&t->lock);
        n = stop_locked(t);
        pthread_mutex_unlock(&t->lock);
        return n;
}

bool trace_active(Trace *t) {
        return atomic_load(&t->active);
}

const char *trace_path(Trace *t) {
        return t->path;
}

static int format_named(char *buf, size_t size, double when, const char *image, uint64_t idx, TraceOp op,
                        const char *source, uint64_t offset, size_t length) {
        return snprintf(buf, size, "%.6f %s %llu %c %s %llu %zu", when, image, (unsigned long long) idx, (char) op,
                        source, (unsigned long long) offset, length);
}

int trace_format(char *buf, size_t size, double when, const char *image, uint64_t idx, TraceOp op,
                 StatsTier source, uint64_t offset, size_t length) {
        return format_named(buf, size, when, image, idx, op, stats_tier_name(source), offset, length);
}

void trace_record(Trace *t, const char *image, uint64_t idx, TraceOp op, StatsTier source, uint64_t offset,
                  size_t length) {
        trace_record_named(t, image, idx, op, stats_tier_name(source), offset, length);
}

void trace_record_named(Trace *t, const char *image, uint64_t idx, TraceOp op, const char *source, uint64_t offset,
                        size_t length) {
        struct timespec ts;
        char line[128];

        if (!atomic_load(&t->active))
                return;
        clock_gettime(CLOCK_REALTIME, &ts);
        format_named(line, sizeof(line), (double) ts.tv_sec + (double) ts.tv_nsec / 1e9, image, idx, op, source,
                     offset, length);
        pthread_mutex_lock(&t->lock);
        if (t->file) {
                fputs(line, t->file);
                fputc('\n', t->file);
                t->records++;
        }
        pthread_mutex_unlock(&t->lock);
}

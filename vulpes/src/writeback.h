/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "fetch.h"
#include "image.h"

typedef struct Writeback Writeback;

typedef struct WritebackStatus {
        bool trickle;                  /* eager writeback is on */
        uint64_t rate;                 /* its cap in bytes per second, 0: none */
        bool uploading;                /* a pass is running */
        uint64_t uploaded_chunks, uploaded_bytes, failed;
} WritebackStatus;

int writeback_new(Image *const *images, size_t n_images, Cache *cache, Fetcher *fetcher, Writeback **ret);

/* Shutting down, as for hoard.h: halt, free the fetcher, then free. */
void writeback_halt(Writeback *w);
Writeback *writeback_free(Writeback *w);

/* Trickle (eager) writeback: upload flushed chunks in the background, one at a time, at most rate bytes
 * per second (0: unlimited). */
void writeback_set_trickle(Writeback *w, bool enabled, uint64_t rate);

/* Uploads everything flushed but not yet uploaded at full speed (parallel, no cap) and returns once a
 * pass has found nothing left: the number of objects uploaded, or a negative errno. */
int64_t writeback_upload_all(Writeback *w);

void writeback_status(Writeback *w, WritebackStatus *ret);

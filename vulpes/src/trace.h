/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "stats.h"

typedef struct Trace Trace;

typedef enum TraceOp {
        TRACE_READ = 'r',
        TRACE_WRITE = 'w',
} TraceOp;

int trace_new(Trace **ret);
Trace *trace_free(Trace *t);

/*
 * Starts writing every chunk access to path (appending; a header line starts each run), replacing a
 * running trace.  Format (doc/vulpes.md): "# vulpes-trace 3 disk.chunk_size=N memory.chunk_size=M" (each of
 * the n_images images and its chunk size) then one line per access to a chunk, "<unix time, µs precision>
 * <image> <chunk index> <r|w> <source> <offset> <length>", source being a StatsTier name and offset, length
 * the bytes of the image the access touched in that chunk.
 */
int trace_start(Trace *t, const char *path, const char *const images[], const uint32_t chunk_sizes[],
                size_t n_images);

/* Stops tracing and flushes the file; returns the number of records written by this run. */
uint64_t trace_stop(Trace *t);

bool trace_active(Trace *t);
const char *trace_path(Trace *t);   /* NULL when inactive; valid until the next start or stop */

void trace_record(Trace *t, const char *image, uint64_t idx, TraceOp op, StatsTier source, uint64_t offset,
                  size_t length);
/* trace_record() with a source that is no tier: `mapped` (warm.c). */
void trace_record_named(Trace *t, const char *image, uint64_t idx, TraceOp op, const char *source, uint64_t offset,
                        size_t length);

/* Formats one record as trace_record() writes it (without newline); used by the unit test. */
int trace_format(char *buf, size_t size, double when, const char *image, uint64_t idx, TraceOp op,
                 StatsTier source, uint64_t offset, size_t length);

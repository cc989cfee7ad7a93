/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>

typedef struct BufPool BufPool;

/*
 * A pool of buffers of one size (buf_size rounded up to whole pages, page-aligned), carved from 4 MiB
 * anonymous mappings populated up front.  A returned buffer is kept for the next bufpool_get(), never
 * given back to the system before bufpool_free(): the pool's footprint is the most buffers ever out at
 * once, plus at most one slab.  The slabs are left out of core dumps.  Contents of a new buffer are
 * undefined; wiping secrets before bufpool_put() is the caller's job.  Safe from any thread.
 */
int bufpool_new(size_t buf_size, BufPool **ret);

/* Unmaps everything; every buffer must have been returned (or is never used again). */
BufPool *bufpool_free(BufPool *p);

/* A buffer, or NULL when memory is exhausted. */
void *bufpool_get(BufPool *p);
void bufpool_put(BufPool *p, void *buf);

size_t bufpool_buf_size(const BufPool *p);

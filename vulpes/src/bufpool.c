/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Pools of equal-sized buffers, for chunk plaintext in the RAM cache and for objects read from the cache.
 *
 * Why not malloc: a 128 KiB chunk sits at glibc's mmap threshold, so each load got fresh memory from the
 * kernel (an mmap, or an arena grown by mprotect) and took one page fault per 4 KiB page on first touch
 * — about a quarter of vulpes's CPU time on a warm-cache sequential read, more than SHA-256.  A pool
 * carves buffers from 4 MiB slabs populated in one call (MADV_POPULATE_WRITE: about half the cost of the
 * faults), and keeps every returned buffer for reuse, so a steady stream of loads and evictions touches
 * only warm memory.  Transparent huge pages were tried and are much slower here: in a VM, a huge page is
 * fresh guest memory that the host must fault in 4 KiB at a time.
 *
 * Threading: safe from any thread; one mutex guards the free list.  New slabs are mapped and populated
 * outside it.
 */
#define _GNU_SOURCE
#include "bufpool.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLAB_BYTES ((size_t) 4 << 20)      /* at least one buffer per slab */

typedef struct Slab {
        struct Slab *next;
        void *base;
        size_t len;
} Slab;

typedef struct FreeBuf {
        struct FreeBuf *next;
} FreeBuf;

struct BufPool {
        size_t buf_size, slab_len;
        pthread_mutex_t lock;
        FreeBuf *free;
        Slab *slabs;
};

static size_t round_up(size_t n, size_t to) {
        return (n + to - 1) / to * to;
}

int bufpool_new(size_t buf_size, BufPool **ret) {
        long page = sysconf(_SC_PAGESIZE);
        BufPool *p;

        if (buf_size == 0)
                return -EINVAL;
        p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->buf_size = round_up(buf_size, page > 0 ? (size_t) page : 4096);
        p->slab_len = p->buf_size < SLAB_BYTES ? SLAB_BYTES / p->buf_size * p->buf_size : p->buf_size;
        pthread_mutex_init(&p->lock, NULL);
        *ret = p;
        return 0;
}

BufPool *bufpool_free(BufPool *p) {
        if (!p)
                return NULL;
        while (p->slabs) {
                Slab *s = p->slabs;

                p->slabs = s->next;
                munmap(s->base, s->len);
                free(s);
        }
        pthread_mutex_destroy(&p->lock);
        free(p);
        return NULL;
}

size_t bufpool_buf_size(const BufPool *p) {
        return p->buf_size;
}

/* Maps and populates a slab; NULL on failure. */
static Slab *slab_map(size_t len) {
        Slab *s;

        s = malloc(sizeof(*s));
        if (!s)
                return NULL;
        s->base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (s->base == MAP_FAILED) {
                free(s);
                return NULL;
        }
        /* Plaintext has no business in a core dump (a file on disk). */
        madvise(s->base, len, MADV_DONTDUMP);
        /* One call instead of a fault per page; without it (Linux < 5.14) pages fault in on first use. */
#ifdef MADV_POPULATE_WRITE
        madvise(s->base, len, MADV_POPULATE_WRITE);
#endif
        s->len = len;
        return s;
}

void *bufpool_get(BufPool *p) {
        FreeBuf *b;
        Slab *s;

        pthread_mutex_lock(&p->lock);
        b = p->free;
        if (b)
                p->free = b->next;
        pthread_mutex_unlock(&p->lock);
        if (b)
                return b;

        s = slab_map(p->slab_len);
        if (!s)
                return NULL;
        pthread_mutex_lock(&p->lock);
        s->next = p->slabs;
        p->slabs = s;
        /* Keep the first buffer, put the others on the free list. */
        for (size_t off = p->slab_len / p->buf_size * p->buf_size; off > p->buf_size; off -= p->buf_size) {
                b = (FreeBuf *) ((uint8_t *) s->base + off - p->buf_size);
                b->next = p->free;
                p->free = b;
        }
        pthread_mutex_unlock(&p->lock);
        return s->base;
}

void bufpool_put(BufPool *p, void *buf) {
        FreeBuf *b = buf;

        if (!buf)
                return;
        pthread_mutex_lock(&p->lock);
        b->next = p->free;
        p->free = b;
        pthread_mutex_unlock(&p->lock);
}

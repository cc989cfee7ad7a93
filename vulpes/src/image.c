/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * One image (disk or memory) of a parcel: chunk state, the bounded RAM cache of plaintext chunks,
 * read-modify-write of partial chunk writes, and flushing dirty chunks to the cache and keyring.
 *
 * A chunk is ABSENT (not in RAM), LOADING (one thread fetches it; others wait on the condition variable,
 * so concurrent reads of one chunk cause one load) or READY.  READY chunks that are clean sit in an LRU
 * list and are evicted when RAM is over its limit; dirty chunks are pinned until a flush has made them
 * durable.  Readers pin a chunk while copying out of it, outside the lock; writers copy in under the
 * lock, so a flush's snapshot of a chunk never sees half a write.
 *
 * Read order: RAM, the persistent cache, lookaside sources, the server (demand priority).  Every object
 * is verified against its tag by the tier that supplied it (chunk_verify_tag) before it is decoded.
 *
 * Durability: image_flush() encodes every chunk that was dirty when it was called, writes the objects
 * as temporary files, syncs, renames them into place, syncs again, and only then commits the new records
 * to the keyring (synchronous=FULL).  A kill -9 at any instant leaves the keyring naming only objects
 * that are on disk: either the old record or the new one, never a dangling one.
 *
 * Room: a chunk that becomes dirty reserves room in the cache for its largest object first
 * (cache_reserve()), and its flush spends that reservation, so a flush does not fail for lack of space
 * after the write was acknowledged; a write without room fails with ENOSPC before it changes anything.
 * A punched chunk (image_punch()) is dirty zeros without room (`zeroed`): its flush stores nothing, so it
 * needs none and is not counted as unreserved, and a write to it reserves first like a write to a clean
 * chunk (with full_waits too: a guest's freed pages punched and then used again must not look like writes
 * the cache had no room for).
 *
 * Threading: every function is safe from any thread.  Lock order: flush_lock, then lock, then db_lock.
 * Besides the callers' threads: one flusher and READAHEAD_WORKERS readahead workers per image.
 */
#define _GNU_SOURCE
#include "image.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bufpool.h"
#include "chunk.h"
#include "compress.h"
#include "crypto.h"
#include "hex.h"
#include "keyring.h"
#include "log.h"
#include "pack.h"

enum {
        CHUNK_ABSENT,
        CHUNK_LOADING,
        CHUNK_READY,
        CHUNK_PARTIAL,                     /* some pages written, the rest not fetched (see "partial chunks") */
};

/*
 * Partial chunks (image_set_partial_writes(); both images: "pages" below are its unit, 4 KiB pages for the
 * memory image, 512-byte sectors for the disk, whose guest writes 1 KiB file system blocks).  A write of whole
 * pages to a chunk that is
 * neither in RAM nor in the cache does not wait for the chunk: the pages go into a buffer of the chunk's size,
 * a bitmap records which, the chunk is PARTIAL (and dirty), and its object is asked for at hoard priority.
 * Reads of written pages are served from it, reads of the others from the resume pack where it has them;
 * any other read, a write of part of a page, or a flush completes it: the object (from the cache, or
 * fetched) fills the pages not written.  A punch, or writes of every page, make it whole without the
 * object.  The background flusher completes only the partial chunks whose object is in the cache; an
 * explicit flush (fsync, a suspend) asks for all the others at once, at demand priority, and completes them.
 *
 * Why: QEMU punches the pages a guest reports free (virtio-balloon's free page reporting) out of the memory
 * image, and before each hole the kernel writes back every dirty page of the file from the hole's start to
 * its end (fuse_writeback_range()), while QEMU waits in fallocate().  Each such page whose chunk was not here
 * cost a demand fetch of that chunk: at 10 Mbit/s +20 ms about 50 of them, one after another, before a
 * resumed guest answered (BENCHMARKS.md, "writes that do not wait for their chunk").  On the disk, a guest at a
 * fresh site writes its files' blocks into chunks it never read: each write waited for its chunk too.
 */

#define NO_CHUNK INT64_C(-1)
#define FLUSH_BATCH_BYTES ((size_t) 32 << 20)

/*
 * Sequential readahead: the kernel sends FUSE reads of at most 128 KiB one or two at a time (the bdi's
 * readahead is capped at its default whatever max_readahead says), so a sequential reader would wait
 * for one cache read + verify + decrypt + decompress per chunk on a single thread.  Instead, a read that
 * continues the previous one schedules the next chunks that are in the cache, and workers load them
 * into RAM while the kernel copies the current one out.
 */
#define READAHEAD_BYTES ((uint64_t) 8 << 20)
enum {
        READAHEAD_WORKERS = 16,            /* a cold cache file costs two dependent disk reads (its directory,
                                            * then the object): keep many in flight to keep both cores busy */
        READAHEAD_QUEUE = 64,
        READAHEAD_SLACK = 4,               /* chunks a sequential read may lag behind the furthest one */
        READAHEAD_FETCH = 4,               /* chunks after a sequential read fetched from the server */
};

/* One part of the resume pack: its payload and the extents that point into it. */
typedef struct Pack {
        uint8_t *payload;
        size_t len;
        PackExtent *extents;
        size_t n;
} Pack;

/*
 * A read of bytes that the resume pack's map puts in a part still on its way waits for that part, rather than
 * fetching the chunk (whose other pages the guest mostly does not touch, and whose transfer slows the pack's),
 * if the part is at most PACK_WAIT_PARTS after the first part not here yet; a part further away would come too
 * late, so its chunk is fetched.  If no part arrives for PACK_STALL_MS, the pack counts as ended: no read waits
 * for it any more.
 */
enum {
        PACK_WAIT_PARTS = 2,
        PACK_STALL_MS = 2000,
};

typedef struct Chunk {
        uint8_t *data;
        uint8_t state;
        bool dirty;
        uint32_t pins;
        uint32_t gen;                      /* bumped by every write, so a flush knows if it saw the last one */
        bool ahead;                        /* loaded by readahead, not read yet: its first read reports ahead_tier */
        bool pack_stale;                   /* written since the resume pack was taken: the pack is not its content */
        bool reserved;                     /* holds room in the cache for its object (dirty chunks only) */
        bool zeroed;                       /* dirty zeros from a punch, not written since: needs no room */
        uint64_t *written;                 /* PARTIAL (and while completing): a bit per page written */
        uint8_t ahead_tier;
        int64_t lru_prev, lru_next;        /* clean READY chunks only; head is the least recently used */
} Chunk;

struct Image {
        char *name;
        ImageSources src;
        uint32_t chunk_size;
        uint64_t size, n_chunks;

        pthread_mutex_t db_lock;           /* the keyring connection is single-threaded */
        Keyring *keyring;

        pthread_mutex_t lock;
        pthread_cond_t cond;               /* chunk state changes, dirty bytes going down */
        bool *present;                     /* has a keyring record */
        KeyringRecord *records;
        uint64_t n_records;
        Chunk *chunks;
        BufPool *chunk_pool;               /* plaintext buffers of chunk_size bytes */
        BufPool *object_pool;              /* buffers for objects read from the cache */
        uint8_t *zeros;                    /* chunk_size zero bytes, what a chunk without record reads as */
        uint8_t kw[IMAGE_KEY_LEN];         /* the parcel key's key-wrapping key, derived once */
        int64_t lru_head, lru_tail;
        uint64_t ram_bytes, ram_limit, dirty_bytes, dirty_chunks;
        int flush_error;
        uint64_t object_max;               /* the room a dirty chunk reserves: its largest object */
        bool full_waits;                   /* without room, writes go ahead unreserved and wait at the RAM bound */
        uint32_t partial_unit;             /* writes of whole units of this many bytes need not fetch their
                                            * chunk (see above); 0: off */
        uint64_t partial_chunks;           /* PARTIAL now */

        /* Readahead, under lock: the chunk after the last read, how far ahead is scheduled, the queue. */
        uint64_t ra_next, ra_end, ra_window;
        uint64_t ra_queue[READAHEAD_QUEUE];
        size_t ra_head, ra_len;
        pthread_cond_t ra_cond;
        pthread_t ra_workers[READAHEAD_WORKERS];
        size_t ra_started;

        /* The resume pack's parts (image_preload): each added under lock, read-only after, freed with the image. */
        Pack packs[IMAGE_PACKS_MAX];
        size_t n_packs;
        uint64_t pack_bytes;
        /* The map of the parts to come (from the part that had one), which parts are here, the first one that
         * is not, when the last one came (CLOCK_MONOTONIC ns), whether no more will (image_preload_end). */
        PackMapEntry *pack_map;
        size_t pack_map_n;
        bool pack_have[IMAGE_PACKS_MAX];
        uint32_t pack_next;
        uint64_t pack_progress_ns;
        bool pack_ended;
        uint64_t pack_waits, pack_wait_ns;

        /* Warming the kernel's page cache (warm.c): the chunks handed out by image_warm_next(), the bytes
         * image_warm_read() served, and every read account() traced (the warmer starts after enough). */
        bool *warmed;
        bool *pack_warmed;                 /* chunks some of whose pages were warmed from the resume pack */
        uint64_t warmed_chunks, warm_bytes;
        atomic_uint_fast64_t traced_reads;

        pthread_mutex_t flush_lock;        /* one flush at a time */
        pthread_t flusher;
        bool flusher_started, stopping, flush_wanted;
        pthread_cond_t flusher_cond;
        unsigned flush_interval_ms;
};

const char *image_name(const Image *img) {
        return img->name;
}

uint64_t image_size(const Image *img) {
        return img->size;
}

uint32_t image_chunk_size(const Image *img) {
        return img->chunk_size;
}

uint64_t image_chunk_count(const Image *img) {
        return img->n_chunks;
}

static size_t length_of(const Image *img, uint64_t idx) {
        return chunk_length(img->size, img->chunk_size, idx);
}

/* --- LRU -------------------------------------------------------------------------------------------- */

static bool lru_linked(Image *img, int64_t idx) {
        return img->chunks[idx].lru_prev != NO_CHUNK || img->lru_head == idx;
}

static void lru_remove(Image *img, int64_t idx) {
        Chunk *c = &img->chunks[idx];

        if (!lru_linked(img, idx))
                return;
        if (c->lru_prev != NO_CHUNK)
                img->chunks[c->lru_prev].lru_next = c->lru_next;
        else
                img->lru_head = c->lru_next;
        if (c->lru_next != NO_CHUNK)
                img->chunks[c->lru_next].lru_prev = c->lru_prev;
        else
                img->lru_tail = c->lru_prev;
        c->lru_prev = c->lru_next = NO_CHUNK;
}

static void lru_append(Image *img, int64_t idx) {
        Chunk *c = &img->chunks[idx];

        lru_remove(img, idx);
        c->lru_prev = img->lru_tail;
        c->lru_next = NO_CHUNK;
        if (img->lru_tail != NO_CHUNK)
                img->chunks[img->lru_tail].lru_next = idx;
        else
                img->lru_head = idx;
        img->lru_tail = idx;
}

/* Wipes a chunk's plaintext and returns its buffer to the pool. */
static void chunk_data_release(Image *img, uint64_t idx, uint8_t *data) {
        if (!data)
                return;
        crypto_wipe(data, length_of(img, idx));
        bufpool_put(img->chunk_pool, data);
}

/* Drops least recently used clean, unpinned chunks until RAM is within its limit. */
static void evict_locked(Image *img) {
        int64_t idx = img->lru_head;

        while (img->ram_bytes > img->ram_limit && idx != NO_CHUNK) {
                Chunk *c = &img->chunks[idx];
                int64_t next = c->lru_next;

                if (c->pins == 0 && !c->dirty && c->state == CHUNK_READY) {
                        lru_remove(img, idx);
                        chunk_data_release(img, (uint64_t) idx, c->data);
                        c->data = NULL;
                        c->state = CHUNK_ABSENT;
                        c->ahead = false;
                        img->ram_bytes -= length_of(img, (uint64_t) idx);
                }
                idx = next;
        }
}

static void install_locked(Image *img, uint64_t idx, uint8_t *data) {
        Chunk *c = &img->chunks[idx];

        evict_locked(img);
        c->data = data;
        c->state = CHUNK_READY;
        img->ram_bytes += length_of(img, idx);
        lru_append(img, (int64_t) idx);
        pthread_cond_broadcast(&img->cond);
}

/* --- loading ---------------------------------------------------------------------------------------- */

static void describe(const Image *img, uint64_t idx, const uint8_t tag[IMAGE_TAG_LEN], char *buf, size_t size) {
        char hex[IMAGE_TAG_LEN * 2 + 1];

        hex_encode(tag, IMAGE_TAG_LEN, hex);
        snprintf(buf, size, "%s chunk %llu (tag %s)", img->name, (unsigned long long) idx, hex);
}

/* Decodes a verified object; a failure here is definitive (the bytes match the tag, so every copy is
 * the same): the keyring's key and the object disagree. */
static int decode(const Image *img, uint64_t idx, const KeyringRecord *rec, const uint8_t key[IMAGE_KEY_LEN],
                  const uint8_t *object, size_t len, uint8_t *data) {
        char what[160];
        int r;

        r = chunk_decode_verified(object, len, key, length_of(img, idx), data);
        if (r < 0) {
                describe(img, idx, rec->tag, what, sizeof(what));
                log_error("failed to read %s: the object matches its tag but does not decode with the keyring's key",
                          what);
                return -EIO;
        }
        return 0;
}

/*
 * Loads chunk idx from the first tier that has a good copy; called without the lock.  With cache_only
 * (readahead), a chunk that is not good in the cache is left alone (-ENOENT, nothing logged): the reader
 * that needs it goes to the other tiers and reports what goes wrong there.
 */
static int chunk_load(Image *img, uint64_t idx, const KeyringRecord *rec, bool cache_only, FetchPriority priority,
                      uint8_t **ret_data, StatsTier *ret_tier) {
        size_t len = 0;
        uint8_t key[IMAGE_KEY_LEN], *object = NULL, *pooled, *data;
        char what[160];
        int r;

        data = bufpool_get(img->chunk_pool);
        pooled = bufpool_get(img->object_pool);
        if (!data || !pooled) {
                r = -ENOMEM;
                goto out_data;
        }
        r = keyring_unwrap_key_with(img->kw, rec->wkey, key);
        if (r < 0) {
                describe(img, idx, rec->tag, what, sizeof(what));
                log_error("failed to read %s: its keyring record does not unwrap under the parcel key", what);
                r = -EIO;
                goto out_data;
        }

        /* Into a reused buffer: a fresh one would fault in page by page on every load. */
        r = cache_get_into(img->src.cache, rec->tag, pooled, bufpool_buf_size(img->object_pool), &len);
        if (r == 0) {
                object = pooled;
                *ret_tier = STATS_TIER_CACHE;
                goto decode;
        }
        if (r == -ENOBUFS)
                r = cache_get(img->src.cache, rec->tag, &object, &len);
        if (r == 0) {
                *ret_tier = STATS_TIER_CACHE;
                goto decode;
        }
        if (r == -EBADMSG)
                stats_add(&img->src.stats->quarantined, 1);
        if (cache_only) {
                r = -ENOENT;
                goto out_data;
        }

        r = lookaside_get(img->src.lookaside, rec->tag, &object, &len);
        if (r == 0) {
                *ret_tier = STATS_TIER_LOOKASIDE;
                cache_put(img->src.cache, rec->tag, object, len, false);
                goto decode;
        }

        describe(img, idx, rec->tag, what, sizeof(what));
        if (!img->src.fetcher) {
                log_error("failed to read %s: not in the cache or any lookaside source, and no server is configured",
                          what);
                r = -EIO;
                goto out_data;
        }
        r = fetch_get_wait(img->src.fetcher, rec->tag, priority, &object, &len);
        if (r == -ENOENT) {
                log_error("failed to read %s: not in the cache, any lookaside source or on the server", what);
                r = -EIO;
                goto out_data;
        }
        if (r == -EBADMSG) {
                log_error("failed to read %s: every copy failed verification against its tag", what);
                r = -EIO;
                goto out_data;
        }
        if (r < 0) {
                if (r != -ECANCELED)
                        log_error("failed to read %s: %s", what, strerror(-r));
                r = -EIO;
                goto out_data;
        }
        *ret_tier = STATS_TIER_SERVER;
        cache_put(img->src.cache, rec->tag, object, len, false);

decode:
        r = decode(img, idx, rec, key, object, len, data);
        if (object != pooled)
                free(object);
        if (r < 0)
                goto out_data;
        bufpool_put(img->object_pool, pooled);
        crypto_wipe(key, sizeof(key));
        *ret_data = data;
        return 0;

out_data:
        crypto_wipe(key, sizeof(key));
        bufpool_put(img->object_pool, pooled);
        if (data)
                bufpool_put(img->chunk_pool, data);
        return r;
}

/*
 * With the lock held: chunk idx is LOADING while its object is loaded (at `priority` if it must be fetched)
 * without the lock, so that others wait for it; on failure it goes back to state `back`.
 */
static int load_unlocked(Image *img, uint64_t idx, FetchPriority priority, uint8_t back, uint8_t **ret_data,
                         StatsTier *ret_tier) {
        KeyringRecord rec = img->records[idx];
        int r;

        img->chunks[idx].state = CHUNK_LOADING;
        pthread_mutex_unlock(&img->lock);
        r = chunk_load(img, idx, &rec, false, priority, ret_data, ret_tier);
        pthread_mutex_lock(&img->lock);
        if (r < 0) {
                img->chunks[idx].state = back;
                pthread_cond_broadcast(&img->cond);
        }
        return r;
}

/* --- partial chunks (see the top of this file) ------------------------------------------------------ */

/* The units ("pages": img->partial_unit bytes, 4 KiB for the memory image, a 512-byte sector for the disk) of
 * chunk idx, and the bitmap of those a PARTIAL chunk holds. */
static size_t pages_of(const Image *img, uint64_t idx) {
        return (length_of(img, idx) + img->partial_unit - 1) / img->partial_unit;
}

/* Whether [in_chunk, in_chunk + len) of chunk idx is whole units (the chunk's last one may be short). */
static bool whole_pages(const Image *img, uint64_t idx, size_t in_chunk, size_t len) {
        return len > 0 && in_chunk % img->partial_unit == 0 &&
               (len % img->partial_unit == 0 || in_chunk + len == length_of(img, idx));
}

static bool page_written(const Chunk *c, size_t page) {
        return c->written[page / 64] >> (page % 64) & 1;
}

/* How many units of [in_chunk, in_chunk + len) of a PARTIAL chunk were written: 0, some (1) or all (2). */
static int written_pages(const Image *img, const Chunk *c, size_t in_chunk, size_t len) {
        size_t first = in_chunk / img->partial_unit, last = (in_chunk + len - 1) / img->partial_unit, n = 0;

        for (size_t p = first; p <= last; p++)
                n += page_written(c, p);
        return n == 0 ? 0 : n == last - first + 1 ? 2 : 1;
}

/* Records the units of [in_chunk, in_chunk + len) of chunk c as written. */
static void pages_written(const Image *img, Chunk *c, size_t in_chunk, size_t len) {
        for (size_t p = in_chunk / img->partial_unit; p <= (in_chunk + len - 1) / img->partial_unit; p++)
                c->written[p / 64] |= UINT64_C(1) << (p % 64);
}

/* With the lock held: whether a write of [in_chunk, in_chunk + len) of chunk idx goes into a PARTIAL chunk
 * (one already, or one it may start: not in RAM, with a record whose object is not in the cache, and only
 * a server to get it from) rather than through a fetch of the chunk. */
static bool partial_write_wanted_locked(Image *img, uint64_t idx, size_t in_chunk, size_t len) {
        Chunk *c = &img->chunks[idx];

        if (!img->partial_unit || !whole_pages(img, idx, in_chunk, len))
                return false;
        if (c->state == CHUNK_PARTIAL)
                return true;
        return c->state == CHUNK_ABSENT && img->present[idx] && len < length_of(img, idx) && img->src.fetcher &&
               !img->src.lookaside && !cache_has(img->src.cache, img->records[idx].tag);
}

static void prefetch(Image *img, const KeyringRecord *rec, FetchPriority priority);

/* With the lock held: chunk idx (ABSENT) becomes PARTIAL, no page written yet, and its object is asked for at
 * hoard priority: behind every guest read, and paced (on a slow link not at all while the guest misses), but
 * soon, so that the guest's next read of another page of the chunk finds it here. */
static int partial_start_locked(Image *img, uint64_t idx) {
        Chunk *c = &img->chunks[idx];
        uint64_t *written = calloc((pages_of(img, idx) + 63) / 64, sizeof(*written));
        uint8_t *data = written ? bufpool_get(img->chunk_pool) : NULL;

        if (!data) {
                free(written);
                return -ENOMEM;
        }
        evict_locked(img);
        memset(data, 0, length_of(img, idx));
        c->data = data;
        c->written = written;
        c->state = CHUNK_PARTIAL;
        img->ram_bytes += length_of(img, idx);
        img->partial_chunks++;
        stats_add(&img->src.stats->partial_chunks, 1);
        prefetch(img, &img->records[idx], FETCH_HOARD);
        return 0;
}

/* With the lock held: a PARTIAL chunk (or one completing) is whole, and READY. */
static void partial_end_locked(Image *img, uint64_t idx) {
        Chunk *c = &img->chunks[idx];

        free(c->written);
        c->written = NULL;
        c->state = CHUNK_READY;
        img->partial_chunks--;
        if (!c->dirty)                     /* a write that started it failed: clean, so it may be evicted */
                lru_append(img, (int64_t) idx);
        pthread_cond_broadcast(&img->cond);
}

/*
 * With the lock held: completes PARTIAL chunk idx with the pages of its object that were not written, fetched
 * at `priority` if it is not in the cache (the lock is dropped meanwhile; the chunk is LOADING, so others wait
 * for it).  On failure the chunk stays PARTIAL.
 */
static int partial_complete_locked(Image *img, uint64_t idx, FetchPriority priority, StatsTier *ret_tier) {
        Chunk *c = &img->chunks[idx];
        size_t len = length_of(img, idx);
        uint8_t *base = NULL;
        int r = load_unlocked(img, idx, priority, CHUNK_PARTIAL, &base, ret_tier);

        if (r < 0)
                return r;
        for (size_t p = 0; p < pages_of(img, idx); p++)
                if (!page_written(c, p)) {
                        size_t at = p * img->partial_unit;

                        memcpy(c->data + at, base + at,
                               len - at < img->partial_unit ? len - at : img->partial_unit);
                }
        chunk_data_release(img, idx, base);
        partial_end_locked(img, idx);
        return 0;
}

/*
 * With the lock held: returns with chunk idx READY, loading it if needed (which drops the lock for the
 * load).  With whole, the caller overwrites the whole chunk: nothing needs to be read.
 */
static int chunk_ready_locked(Image *img, uint64_t idx, bool whole, StatsTier *ret_tier) {
        Chunk *c = &img->chunks[idx];

        *ret_tier = STATS_TIER_RAM;
        for (;;) {
                uint8_t *data = NULL;
                int r;

                if (c->state == CHUNK_PARTIAL) {
                        if (!whole)
                                return partial_complete_locked(img, idx, FETCH_DEMAND, ret_tier);
                        partial_end_locked(img, idx);
                        *ret_tier = STATS_TIER_NEW;
                        return 0;
                }
                if (c->state == CHUNK_READY) {
                        if (c->ahead) {
                                c->ahead = false;
                                *ret_tier = (StatsTier) c->ahead_tier;
                        }
                        return 0;
                }
                if (c->state == CHUNK_LOADING) {
                        pthread_cond_wait(&img->cond, &img->lock);
                        continue;
                }
                if (whole || !img->present[idx]) {
                        data = bufpool_get(img->chunk_pool);
                        if (!data)
                                return -ENOMEM;
                        if (!whole)
                                memset(data, 0, length_of(img, idx));
                        install_locked(img, idx, data);
                        *ret_tier = whole ? STATS_TIER_NEW : STATS_TIER_ZERO;
                        return 0;
                }
                r = load_unlocked(img, idx, FETCH_DEMAND, CHUNK_ABSENT, &data, ret_tier);
                if (r < 0)
                        return r;
                install_locked(img, idx, data);
                return 0;
        }
}

/*
 * With the lock held, at the start of a read of chunks first..last.  A read that starts near where the
 * stream of reads has got to is sequential (the kernel's own readahead sends requests on several threads,
 * so they arrive slightly out of order): the chunks of the window after it that are neither in RAM nor
 * being loaded are marked LOADING and queued for the readahead workers.  Readers of a queued chunk wait
 * for it as for any load; if the worker cannot get it from the cache, they load it themselves.
 */
static void readahead_locked(Image *img, uint64_t first, uint64_t last) {
        bool sequential = first <= img->ra_next + 1 && first + READAHEAD_SLACK >= img->ra_next;
        uint64_t idx, end;

        if (img->ra_started == 0 || !sequential) {
                img->ra_next = last + 1;
                img->ra_end = last + 1;
                return;
        }
        if (last + 1 > img->ra_next)
                img->ra_next = last + 1;
        idx = img->ra_end > last + 1 ? img->ra_end : last + 1;
        end = last + 1 + img->ra_window < img->n_chunks ? last + 1 + img->ra_window : img->n_chunks;
        for (; idx < end && img->ra_len < READAHEAD_QUEUE; idx++) {
                Chunk *c = &img->chunks[idx];

                if (c->state != CHUNK_ABSENT || !img->present[idx])
                        continue;
                c->state = CHUNK_LOADING;
                img->ra_queue[(img->ra_head + img->ra_len) % READAHEAD_QUEUE] = idx;
                img->ra_len++;
                pthread_cond_signal(&img->ra_cond);
        }
        img->ra_end = idx;
}

typedef struct Prefetch {
        Cache *cache;
        uint8_t tag[IMAGE_TAG_LEN];
} Prefetch;

/* On the fetch thread: a prefetched object (verified against its tag by the fetcher) goes to the cache. */
static void prefetch_done(int result, const uint8_t *object, size_t len, void *userdata) {
        Prefetch *p = userdata;

        if (result == 0)
                cache_put(p->cache, p->tag, object, len, false);
        free(p);
}

/*
 * A chunk just after a sequential read is not in the cache: fetch it into the cache at readahead priority
 * (paced, behind every demand request but before other background, of which there can be seconds queued:
 * the partial chunks' objects, a working set), so that the reader finds it there or joins the transfer under
 * way (fetch.c moves it to demand priority).  Partial chunks have their objects fetched the same way, at
 * hoard priority.  Without this a cold sequential read waited one round trip per chunk: the kernel reads
 * ahead little (mount.c) and the guest's own is one request at a time.
 */
static void prefetch(Image *img, const KeyringRecord *rec, FetchPriority priority) {
        Prefetch *p;

        /* With lookaside sources the reader tries them before the server: leave the chunk to it. */
        if (!img->src.fetcher || img->src.lookaside || !(p = malloc(sizeof(*p))))
                return;
        p->cache = img->src.cache;
        memcpy(p->tag, rec->tag, IMAGE_TAG_LEN);
        if (fetch_get(img->src.fetcher, p->tag, priority, prefetch_done, p) < 0)
                free(p);
}

/*
 * Whether the link is fast enough for a resumed guest's likely chunks to come while it waits for others: a
 * whole chunk fits in its bandwidth-delay product (at 100 Mbit/s +20 ms about 250 KB; at 10 Mbit/s about
 * 33 KB, where with them the guest answered after 4.3-4.6 s instead of 2.8-3.2, and its workload took 14-17 s
 * instead of 12-13).  A count of objects in flight (of their mean size, a few kilobytes to a chunk) once took
 * the 10 Mbit/s link for a fast one.
 */
static bool fast_link(Image *img) {
        return img->src.fetcher && fetch_bdp_bytes(img->src.fetcher) >= img->chunk_size;
}

/*
 * With the lock held: the priority of the server fetches after a sequential read.  An image with a resume
 * pack is a resumed guest's memory: its "sequential" reads are faults in neighbouring chunks, less certain
 * than a sequential reader's, so they come after the disk's; while the pack is on its way its parts are what
 * the guest reads next (at readahead priority then, these took the link from the pack and the guest answered
 * after 1.9 s instead of 1.4 at 100 Mbit/s +20 ms).  On a slow link (!fast_link()) every readahead fetch
 * stays with the hoard: there the memory image's are whole chunks for a page or two, which the guest's misses
 * would wait behind (at 10 Mbit/s +20 ms the workload took 15.5 s instead of 12-13 with them ahead of the
 * hoard), and even the disk's, ahead of it, gained nothing there (the workload took 12.8 s in three runs,
 * against 12.4-13.1 with them behind it), since every byte that crosses is another's wait on such a link.
 */
static FetchPriority readahead_priority_locked(Image *img) {
        if (!fast_link(img))
                return FETCH_HOARD;
        if (!img->n_packs)
                return FETCH_AHEAD;
        return img->pack_ended ? FETCH_SOON : FETCH_HOARD;
}

/* A readahead worker: loads queued chunks from the cache (verified like every load) into RAM, and has the
 * first few that are not there fetched from the server into the cache. */
static void *readahead_thread(void *userdata) {
        Image *img = userdata;

        pthread_mutex_lock(&img->lock);
        for (;;) {
                StatsTier tier = STATS_TIER_CACHE;
                uint8_t *data = NULL;
                KeyringRecord rec;
                uint64_t idx;
                int r;

                while (!img->stopping && img->ra_len == 0)
                        pthread_cond_wait(&img->ra_cond, &img->lock);
                if (img->stopping)
                        break;
                idx = img->ra_queue[img->ra_head];
                img->ra_head = (img->ra_head + 1) % READAHEAD_QUEUE;
                img->ra_len--;
                rec = img->records[idx];
                pthread_mutex_unlock(&img->lock);
                r = chunk_load(img, idx, &rec, true, FETCH_DEMAND, &data, &tier);
                pthread_mutex_lock(&img->lock);
                if (r == -ENOENT && idx < img->ra_next + READAHEAD_FETCH) {
                        FetchPriority priority = readahead_priority_locked(img);

                        pthread_mutex_unlock(&img->lock);
                        prefetch(img, &rec, priority);
                        pthread_mutex_lock(&img->lock);
                } else if (r == -ENOENT && idx < img->ra_end) {
                        /* Not in the cache and too far ahead to fetch yet: queue it again when the reader
                         * comes nearer. */
                        img->ra_end = idx;
                }
                if (r < 0) {
                        img->chunks[idx].state = CHUNK_ABSENT;
                        pthread_cond_broadcast(&img->cond);
                        continue;
                }
                img->chunks[idx].ahead = true;
                img->chunks[idx].ahead_tier = (uint8_t) tier;
                install_locked(img, idx, data);
        }
        /* Whatever is still queued was never loaded: give it back to the readers. */
        for (; img->ra_len > 0; img->ra_len--, img->ra_head = (img->ra_head + 1) % READAHEAD_QUEUE)
                img->chunks[img->ra_queue[img->ra_head]].state = CHUNK_ABSENT;
        pthread_cond_broadcast(&img->cond);
        pthread_mutex_unlock(&img->lock);
        return NULL;
}

static void account(Image *img, uint64_t idx, TraceOp op, StatsTier tier, uint64_t offset, size_t length) {
        Stats *s = img->src.stats;

        stats_add(&s->hits[tier], 1);
        if (tier != STATS_TIER_RAM)
                stats_add(&s->misses, 1);
        stats_add(op == TRACE_READ ? &s->chunks_read : &s->chunks_written, 1);
        if (op == TRACE_READ)
                atomic_fetch_add(&img->traced_reads, 1);
        trace_record(img->src.trace, img->name, idx, op, tier, offset, length);
}

/* A part's bytes for [pos, pos + len) if one of its extents holds all of them, else NULL. */
static const uint8_t *pack_find(const Pack *pk, uint64_t pos, size_t len) {
        size_t lo = 0, hi = pk->n;
        const PackExtent *e;

        while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;

                if (pk->extents[mid].offset <= pos)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        if (lo == 0)
                return NULL;
        e = &pk->extents[lo - 1];
        return pos + len <= e->offset + e->len ? e->data + (pos - e->offset) : NULL;
}

/* The resume pack's bytes for [pos, pos + len) from the first part that holds all of them (parts may
 * overlap: they hold the same version's bytes), else NULL. */
static const uint8_t *pack_find_locked(Image *img, uint64_t pos, size_t len) {
        for (size_t i = 0; i < img->n_packs; i++) {
                const uint8_t *p = pack_find(&img->packs[i], pos, len);

                if (p)
                        return p;
        }
        return NULL;
}

static bool in_pack(const Image *img, const void *p) {
        const uint8_t *b = p;

        for (size_t i = 0; i < img->n_packs; i++)
                if (b >= img->packs[i].payload && b < img->packs[i].payload + img->packs[i].len)
                        return true;
        return false;
}

static uint64_t monotonic_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t) ts.tv_sec * 1000000000ULL + (uint64_t) ts.tv_nsec;
}

/* The CLOCK_REALTIME time ns from now, for pthread_cond_timedwait() on the image's conditions. */
static struct timespec realtime_after_ns(uint64_t ns) {
        struct timespec ts;

        clock_gettime(CLOCK_REALTIME, &ts);
        ns += (uint64_t) ts.tv_nsec;
        ts.tv_sec += (time_t) (ns / 1000000000ULL);
        ts.tv_nsec = (long) (ns % 1000000000ULL);
        return ts;
}

int image_preload(Image *img, uint8_t *payload, size_t len, uint32_t part) {
        PackInfo info;
        uint64_t bytes = 0;
        int r;

        if (part >= IMAGE_PACKS_MAX)
                return -EINVAL;
        r = pack_parse(payload, len, img->size, &info);
        if (r < 0)
                return r;
        for (size_t i = 0; i < info.n; i++)
                bytes += info.extents[i].len;
        pthread_mutex_lock(&img->lock);
        if (img->n_packs == IMAGE_PACKS_MAX || img->pack_have[part]) {
                pthread_mutex_unlock(&img->lock);
                pack_info_free(&info);
                return -EBUSY;
        }
        img->packs[img->n_packs++] = (Pack) { .payload = payload, .len = len, .extents = info.extents, .n = info.n };
        img->pack_bytes += bytes;
        img->pack_have[part] = true;
        while (img->pack_next < IMAGE_PACKS_MAX && img->pack_have[img->pack_next])
                img->pack_next++;
        img->pack_progress_ns = monotonic_ns();
        if (info.map && !img->pack_map) {
                img->pack_map = info.map;
                img->pack_map_n = info.n_map;
        } else {
                free(info.map);
        }
        pthread_cond_broadcast(&img->cond);
        pthread_mutex_unlock(&img->lock);
        log_info("%s: resume pack part %u of %zu extents, %llu bytes%s", img->name, part, info.n,
                 (unsigned long long) bytes, info.map ? ", with the map of the parts to come" : "");
        return 0;
}

/*
 * With the lock held: the records of the chunks that hold the resume pack's pages, part by part (the pack's
 * order: the pages the guest touched first after its previous resume come first), each once, that are neither
 * in RAM nor zero.  Returns how many went to *ret (malloc()ed), or -ENOMEM.
 */
static ssize_t pack_chunks_locked(Image *img, KeyringRecord **ret) {
        uint8_t *seen = calloc(img->n_chunks / 8 + 1, 1);
        KeyringRecord *list = NULL;
        size_t n = 0, cap = 0;

        if (!seen)
                return -ENOMEM;
        for (size_t p = 0; p < img->n_packs; p++)
                for (size_t e = 0; e < img->packs[p].n; e++) {
                        const PackExtent *x = &img->packs[p].extents[e];
                        uint64_t last = (x->offset + x->len - 1) / img->chunk_size;

                        for (uint64_t idx = x->offset / img->chunk_size; idx <= last && idx < img->n_chunks; idx++) {
                                if (seen[idx / 8] & (1u << (idx % 8)))
                                        continue;
                                seen[idx / 8] |= (uint8_t) (1u << (idx % 8));
                                if (!img->present[idx] || img->chunks[idx].state == CHUNK_READY)
                                        continue;
                                if (n == cap) {
                                        KeyringRecord *grown = realloc(list,
                                                                       (cap = cap ? 2 * cap : 256) * sizeof(*list));

                                        if (!grown) {
                                                free(list);
                                                free(seen);
                                                return -ENOMEM;
                                        }
                                        list = grown;
                                }
                                list[n++] = img->records[idx];
                        }
                }
        free(seen);
        *ret = list;
        return (ssize_t) n;
}

void image_preload_end(Image *img, uint64_t rate) {
        KeyringRecord *chunks = NULL;
        ssize_t n;

        /* The pack's parts were most of what the link carried so far: vulpes's own GETs, a few misses, say
         * little of its rate yet. */
        if (rate && img->src.fetcher)
                fetch_note_rate(img->src.fetcher, rate);
        pthread_mutex_lock(&img->lock);
        img->pack_ended = true;
        pthread_cond_broadcast(&img->cond);
        /*
         * The guest went on to touch other pages of the pack's chunks at its previous site too, and at the
         * next: at 100 Mbit/s +20 ms its misses in the workload were all such pages (33-44 round trips), with
         * these chunks in the working set's stream at idle priority, which a guest that misses now and then
         * holds back.  They come now, before the rest of the background, where the link is fast enough
         * (fast_link()).  On a slower one they are whole chunks for a few pages each (at
         * 10 Mbit/s +20 ms, 13-16 MB for an 8 MiB pack: the guest answered after 4.3-4.6 s instead of
         * 2.8-3.2), and stay in the working set's stream.
         */
        n = fast_link(img) ? pack_chunks_locked(img, &chunks) : 0;
        pthread_mutex_unlock(&img->lock);
        for (ssize_t i = 0; i < n; i++)
                if (!cache_has(img->src.cache, chunks[i].tag))
                        prefetch(img, &chunks[i], FETCH_SOON);
        free(chunks);
}

/*
 * Whether a read of [pos, pos + len) should wait for a part of the resume pack on its way (see PACK_WAIT_PARTS);
 * if so, waits (under lock) until a part comes, the pack ends or stalls, and returns true: the caller looks
 * again.
 */
static bool pack_wait_locked(Image *img, uint64_t pos, size_t len) {
        const PackMapEntry *e;
        uint64_t now, deadline_ns;
        struct timespec deadline;

        if (img->pack_ended || !img->pack_map)
                return false;
        e = pack_map_find(img->pack_map, img->pack_map_n, pos);
        if (!e || pos + len > e->offset + e->len || img->pack_have[e->part] ||
            e->part > img->pack_next + PACK_WAIT_PARTS - 1)
                return false;
        now = monotonic_ns();
        deadline_ns = img->pack_progress_ns + (uint64_t) PACK_STALL_MS * 1000000ULL;
        if (now >= deadline_ns) {
                log_info("%s: no resume pack part for %d ms: reads no longer wait for the pack", img->name,
                         PACK_STALL_MS);
                img->pack_ended = true;
                return false;
        }
        deadline = realtime_after_ns(deadline_ns - now);
        img->pack_waits++;
        pthread_cond_timedwait(&img->cond, &img->lock, &deadline);
        img->pack_wait_ns += monotonic_ns() - now;
        return true;
}

size_t image_read_pieces_max(const Image *img, size_t len) {
        /* An unaligned start adds one chunk. */
        return len > 0 ? (len - 1) / img->chunk_size + 2 : 0;
}

ssize_t image_read_pin(Image *img, size_t len, uint64_t offset, struct iovec *iov, size_t max_iov, size_t *ret_n) {
        size_t done = 0, n = 0;

        *ret_n = 0;
        if (offset >= img->size)
                return 0;
        if (len > img->size - offset)
                len = (size_t) (img->size - offset);
        if (max_iov < image_read_pieces_max(img, len))
                return -EINVAL;
        while (done < len) {
                uint64_t pos = offset + done, idx = pos / img->chunk_size;
                size_t in_chunk = (size_t) (pos % img->chunk_size), piece = length_of(img, idx) - in_chunk;
                StatsTier tier;
                Chunk *c = &img->chunks[idx];
                int r;

                if (piece > len - done)
                        piece = len - done;
                pthread_mutex_lock(&img->lock);
                if (done == 0)
                        readahead_locked(img, idx, (offset + len - 1) / img->chunk_size);
                if (c->state == CHUNK_ABSENT && !img->present[idx]) {
                        /* A chunk without record is zeros: no need to hold it in RAM for a read. */
                        pthread_mutex_unlock(&img->lock);
                        iov[n++] = (struct iovec) { .iov_base = img->zeros, .iov_len = piece };
                        account(img, idx, TRACE_READ, STATS_TIER_ZERO, pos, piece);
                        done += piece;
                        continue;
                }
                if (c->state == CHUNK_PARTIAL && written_pages(img, c, in_chunk, piece) == 2) {
                        c->pins++;
                        pthread_mutex_unlock(&img->lock);
                        iov[n++] = (struct iovec) { .iov_base = c->data + in_chunk, .iov_len = piece };
                        account(img, idx, TRACE_READ, STATS_TIER_RAM, pos, piece);
                        done += piece;
                        continue;
                }
                /* The pack holds what the chunk was at the suspend: for the pages not written since. */
                if (c->state != CHUNK_READY && img->n_packs &&
                    (!c->pack_stale || (c->state == CHUNK_PARTIAL && written_pages(img, c, in_chunk, piece) == 0))) {
                        const uint8_t *p = pack_find_locked(img, pos, piece);

                        if (p) {
                                pthread_mutex_unlock(&img->lock);
                                iov[n++] = (struct iovec) { .iov_base = (void *) p, .iov_len = piece };
                                account(img, idx, TRACE_READ, STATS_TIER_PACK, pos, piece);
                                done += piece;
                                continue;
                        }
                        if (pack_wait_locked(img, pos, piece)) {
                                pthread_mutex_unlock(&img->lock);
                                continue;
                        }
                }
                r = chunk_ready_locked(img, idx, false, &tier);
                if (r < 0) {
                        /* Whole or not at all: a short read is the end of the file to the kernel (after a
                         * buffered read it shrinks the file's size, fuse_short_read()) and to QEMU, which
                         * pads it with zeros for the guest.  The pieces pinned so far go back to the caller
                         * for image_read_release(). */
                        pthread_mutex_unlock(&img->lock);
                        stats_add(&img->src.stats->errors, 1);
                        *ret_n = n;
                        return r;
                }
                c->pins++;
                if (!c->dirty)
                        lru_append(img, (int64_t) idx);
                pthread_mutex_unlock(&img->lock);
                iov[n++] = (struct iovec) { .iov_base = c->data + in_chunk, .iov_len = piece };
                account(img, idx, TRACE_READ, tier, pos, piece);
                done += piece;
        }
        stats_add(&img->src.stats->bytes_read, done);
        *ret_n = n;
        return (ssize_t) done;
}

void image_read_release(Image *img, const struct iovec *iov, size_t n, uint64_t offset) {
        uint64_t pos = offset;

        if (n == 0)
                return;
        pthread_mutex_lock(&img->lock);
        for (size_t i = 0; i < n; pos += iov[i].iov_len, i++)
                if (iov[i].iov_base != img->zeros && !in_pack(img, iov[i].iov_base))
                        img->chunks[pos / img->chunk_size].pins--;
        if (img->ram_bytes > img->ram_limit)
                evict_locked(img);
        pthread_mutex_unlock(&img->lock);
}

/* --- warming the kernel's page cache (warm.c) -------------------------------------------------------- */

uint64_t image_traced_reads(Image *img) {
        return atomic_load(&img->traced_reads);
}

int image_warm_next(Image *img, uint64_t *cursor, unsigned flags, uint64_t *ret_idx) {
        bool zeros = flags & IMAGE_WARM_ZEROS;

        pthread_mutex_lock(&img->lock);
        for (; *cursor < img->n_chunks; (*cursor)++) {
                uint64_t idx = *cursor;
                uint8_t tag[IMAGE_TAG_LEN];
                bool local, zero = img->chunks[idx].state == CHUNK_ABSENT && !img->present[idx];

                if (img->warmed[idx] || zero != zeros)
                        continue;
                local = zero || img->chunks[idx].state == CHUNK_READY;
                if (!local && img->chunks[idx].state == CHUNK_ABSENT && !(flags & IMAGE_WARM_RAM_ONLY)) {
                        /* No image lock during I/O: the cache's index is a file system lookup. */
                        memcpy(tag, img->records[idx].tag, IMAGE_TAG_LEN);
                        pthread_mutex_unlock(&img->lock);
                        local = cache_has(img->src.cache, tag);
                        pthread_mutex_lock(&img->lock);
                }
                if (!local || img->warmed[idx])
                        continue;
                img->warmed[idx] = true;
                img->warmed_chunks++;
                (*cursor)++;
                pthread_mutex_unlock(&img->lock);
                *ret_idx = idx;
                return 0;
        }
        pthread_mutex_unlock(&img->lock);
        return -ENOENT;
}

void image_trace_mapped(Image *img, uint64_t offset, size_t length) {
        trace_record_named(img->src.trace, img->name, offset / img->chunk_size, TRACE_READ, "mapped", offset, length);
}

int image_warm_pack_next(Image *img, uint64_t *cursor, uint64_t *ret_offset, uint64_t *ret_len) {
        pthread_mutex_lock(&img->lock);
        for (;;) {
                size_t k = (size_t) (*cursor >> 32), i = (size_t) (*cursor & UINT32_MAX);
                const PackExtent *e;

                if (k >= img->n_packs) {
                        pthread_mutex_unlock(&img->lock);
                        return -ENOENT;
                }
                if (i >= img->packs[k].n) {
                        *cursor = (uint64_t) (k + 1) << 32;
                        continue;
                }
                (*cursor)++;
                e = &img->packs[k].extents[i];
                for (uint64_t idx = e->offset / img->chunk_size, last = (e->offset + e->len - 1) / img->chunk_size;
                     idx <= last; idx++)
                        img->pack_warmed[idx] = true;
                *ret_offset = e->offset;
                *ret_len = e->len;
                pthread_mutex_unlock(&img->lock);
                return 0;
        }
}

bool image_warmed(Image *img, uint64_t idx) {
        bool warmed;

        pthread_mutex_lock(&img->lock);
        warmed = idx < img->n_chunks && (img->warmed[idx] || img->pack_warmed[idx]);
        pthread_mutex_unlock(&img->lock);
        return warmed;
}

/*
 * One chunk's piece for image_warm_read(), with the lock held (dropped and taken again while an object is
 * decoded): from RAM, from zeros, or decoded from the cache into a buffer that is not kept, so warming neither
 * fetches nor pushes the guest's chunks out of RAM.  -EAGAIN for anything else (a chunk on its way, partly
 * written): the kernel then leaves those pages out, and a fault on one is an ordinary read.  The pages the
 * kernel asks for are ones it does not hold, so no write of them can be on its way: the cache's object (even
 * one a flush has since replaced) is their content.
 */
static int warm_piece_locked(Image *img, uint64_t idx, size_t in_chunk, size_t piece, uint8_t *out) {
        Chunk *c = &img->chunks[idx];
        const uint8_t *p;
        KeyringRecord rec;
        StatsTier tier;
        uint8_t *data = NULL;
        int r;

        if (c->state == CHUNK_ABSENT && !img->present[idx]) {
                memset(out, 0, piece);
                return 0;
        }
        if (c->state == CHUNK_READY) {
                memcpy(out, c->data + in_chunk, piece);
                return 0;
        }
        /* The pack holds what the chunk was at the suspend: for a chunk not written since. */
        if ((c->state == CHUNK_ABSENT || c->state == CHUNK_LOADING) && img->n_packs && !c->pack_stale &&
            (p = pack_find_locked(img, idx * img->chunk_size + in_chunk, piece))) {
                memcpy(out, p, piece);
                return 0;
        }
        if (c->state != CHUNK_ABSENT)
                return -EAGAIN;
        rec = img->records[idx];
        pthread_mutex_unlock(&img->lock);
        r = chunk_load(img, idx, &rec, true, FETCH_HOARD, &data, &tier);
        if (r == 0) {
                memcpy(out, data + in_chunk, piece);
                bufpool_put(img->chunk_pool, data);
        }
        pthread_mutex_lock(&img->lock);
        return r == -ENOENT ? -EAGAIN : r;
}

ssize_t image_warm_read(Image *img, void *buf, size_t len, uint64_t offset) {
        size_t done = 0;
        int r = 0;

        if (offset >= img->size)
                return 0;
        if (len > img->size - offset)
                len = (size_t) (img->size - offset);
        pthread_mutex_lock(&img->lock);
        while (done < len) {
                uint64_t pos = offset + done, idx = pos / img->chunk_size;
                size_t in_chunk = (size_t) (pos % img->chunk_size), piece = length_of(img, idx) - in_chunk;

                if (piece > len - done)
                        piece = len - done;
                r = warm_piece_locked(img, idx, in_chunk, piece, (uint8_t *) buf + done);
                if (r < 0)
                        break;
                done += piece;
        }
        if (r == 0)
                img->warm_bytes += done;
        pthread_mutex_unlock(&img->lock);
        /* All or nothing: a short reply would be the end of the file to the kernel (mount.c). */
        return r < 0 ? r : (ssize_t) done;
}

ssize_t image_read(Image *img, void *buf, size_t len, uint64_t offset) {
        uint8_t *out = buf;
        size_t done = 0;

        /* One chunk at a time, so that a long read pins at most one chunk. */
        while (done < len) {
                struct iovec iov[2];
                size_t n = 0, want = img->chunk_size - (size_t) ((offset + done) % img->chunk_size);
                ssize_t got;

                if (want > len - done)
                        want = len - done;
                got = image_read_pin(img, want, offset + done, iov, 2, &n);
                if (got < 0)
                        return done > 0 ? (ssize_t) done : got;
                for (size_t i = 0, at = 0; i < n; at += iov[i].iov_len, i++)
                        memcpy(out + done + at, iov[i].iov_base, iov[i].iov_len);
                image_read_release(img, iov, n, offset + done);
                if (got == 0)
                        break;
                done += (size_t) got;
                if ((size_t) got < want)
                        break;
        }
        return (ssize_t) done;
}

static void flusher_kick_locked(Image *img) {
        img->flush_wanted = true;
        pthread_cond_signal(&img->flusher_cond);
}

static bool is_full(int r) {
        return r == -ENOSPC || r == -EDQUOT;
}

/*
 * With the lock held, before chunk idx (READY; clean, or dirty zeros from a punch) takes a write: room in the
 * cache for its object.
 * The lock is dropped meanwhile (a reservation may evict, or flush to give back what dirty chunks hold
 * beyond their objects); the chunk is pinned so that it stays in RAM.  Returns 0, or -ENOSPC (only
 * without full_waits: then the chunk goes ahead without room, and its flush reserves again).
 */
static int chunk_reserve_locked(Image *img, uint64_t idx) {
        Chunk *c = &img->chunks[idx];
        int r;

        c->pins++;
        pthread_mutex_unlock(&img->lock);
        r = cache_reserve(img->src.cache, img->object_max);
        if (is_full(r) && !img->full_waits && img->src.make_room) {
                img->src.make_room(img->src.make_room_data, true);
                r = cache_reserve(img->src.cache, img->object_max);
        }
        pthread_mutex_lock(&img->lock);
        c->pins--;
        if (r < 0)
                return img->full_waits ? 0 : r;
        /* Another writer may have made it dirty, with room, meanwhile. */
        if (c->reserved)
                cache_unreserve(img->src.cache, img->object_max);
        c->reserved = true;
        return 0;
}

/*
 * With the lock held, before chunk idx (n bytes) may become dirty: back-pressure, since dirty chunks are
 * pinned and must not fill RAM.  Returns 0, or the standing flush failure.
 */
static int dirty_room_wait_locked(Image *img, uint64_t idx, size_t n) {
        Chunk *c = &img->chunks[idx];

        while (!c->dirty && img->dirty_bytes + n > img->ram_limit / 4 * 3 && img->dirty_chunks > 0) {
                if (img->flush_error && !(img->full_waits && is_full(img->flush_error)))
                        return img->flush_error;
                flusher_kick_locked(img);
                pthread_cond_wait(&img->cond, &img->lock);
        }
        return 0;
}

/* With the lock held, after chunk idx (READY) changed: it is dirty until a flush makes it durable. */
static void chunk_changed_locked(Image *img, uint64_t idx) {
        Chunk *c = &img->chunks[idx];

        c->gen++;
        c->pack_stale = true;
        c->zeroed = false;                 /* a punch sets it again after this */
        if (c->dirty)
                return;
        c->dirty = true;
        img->dirty_bytes += length_of(img, idx);
        img->dirty_chunks++;
        lru_remove(img, (int64_t) idx);
        if (img->dirty_bytes > img->ram_limit / 4)
                flusher_kick_locked(img);
}

ssize_t image_write(Image *img, const void *buf, size_t len, uint64_t offset) {
        const uint8_t *in = buf;
        size_t done = 0;

        if (offset >= img->size)
                return len == 0 ? 0 : -ENOSPC;
        if (len > img->size - offset)
                len = (size_t) (img->size - offset);
        while (done < len) {
                uint64_t pos = offset + done, idx = pos / img->chunk_size;
                size_t n = length_of(img, idx), in_chunk = (size_t) (pos % img->chunk_size), piece = n - in_chunk;
                StatsTier tier;
                Chunk *c = &img->chunks[idx];
                int r;

                if (piece > len - done)
                        piece = len - done;
                pthread_mutex_lock(&img->lock);
                r = dirty_room_wait_locked(img, idx, n);
                if (r >= 0 && partial_write_wanted_locked(img, idx, in_chunk, piece)) {
                        if (c->state != CHUNK_PARTIAL)
                                r = partial_start_locked(img, idx);
                        tier = STATS_TIER_NEW;
                } else if (r >= 0) {
                        r = chunk_ready_locked(img, idx, piece == n, &tier);
                }
                /* Dirty chunks hold room, but for those that went dirty without (full_waits) and punched ones;
                 * a write to a punched one reserves like one to a clean chunk. */
                if (r >= 0 && !c->reserved && (!c->dirty || c->zeroed || !img->full_waits))
                        r = chunk_reserve_locked(img, idx);
                if (r < 0) {
                        pthread_mutex_unlock(&img->lock);
                        stats_add(&img->src.stats->errors, 1);
                        return done > 0 ? (ssize_t) done : r;
                }
                memcpy(c->data + in_chunk, in + done, piece);
                /* Still PARTIAL, or being completed (since the reservation let go of the lock): its pages, not
                 * the object's, are what these now hold. */
                if (c->written) {
                        pages_written(img, c, in_chunk, piece);
                        /* Every page written: whole, nothing to fetch (unless it is being completed already). */
                        if (c->state == CHUNK_PARTIAL && written_pages(img, c, 0, n) == 2)
                                partial_end_locked(img, idx);
                }
                chunk_changed_locked(img, idx);
                pthread_mutex_unlock(&img->lock);
                account(img, idx, TRACE_WRITE, tier, pos, piece);
                done += piece;
        }
        stats_add(&img->src.stats->bytes_written, done);
        return (ssize_t) done;
}

/*
 * With the lock held: whole chunk idx becomes zeros without being read.  A chunk that has no record and
 * is not in RAM is zeros already (returns 0); any other becomes dirty zeros (returns 1), whose flush drops
 * its record (an all-zero chunk has none).  It reserves no room: its flush stores no object.
 */
static int chunk_punch_locked(Image *img, uint64_t idx) {
        StatsTier tier;
        int r;

        if (img->chunks[idx].state == CHUNK_ABSENT && !img->present[idx])
                return 0;
        r = dirty_room_wait_locked(img, idx, length_of(img, idx));
        if (r >= 0)
                r = chunk_ready_locked(img, idx, true, &tier);
        if (r < 0)
                return r;
        memset(img->chunks[idx].data, 0, length_of(img, idx));
        chunk_changed_locked(img, idx);
        img->chunks[idx].zeroed = true;
        /* The kernel drops its pages of the hole: the warmer may fill them again. */
        img->warmed[idx] = false;
        return 1;
}

/* Zeros [offset, end), within one chunk, through the write path (which reads the rest of the chunk). */
static int zero_piece(Image *img, uint64_t offset, uint64_t end) {
        ssize_t w = offset < end ? image_write(img, img->zeros, (size_t) (end - offset), offset) : 0;

        return w < 0 ? (int) w : 0;
}

int image_punch(Image *img, uint64_t offset, uint64_t len) {
        uint64_t end, first, last, head_end;
        int r;

        if (offset >= img->size || len == 0)
                return 0;
        end = len > img->size - offset ? img->size : offset + len;
        /* Chunks first..last-1 lie wholly in [offset, end); the edges are pieces of the chunks around them. */
        first = (offset + img->chunk_size - 1) / img->chunk_size;
        last = end == img->size ? img->n_chunks : end / img->chunk_size;
        head_end = first * img->chunk_size < end ? first * img->chunk_size : end;
        r = zero_piece(img, offset, head_end);
        for (uint64_t idx = first; idx < last && r >= 0; idx++) {
                pthread_mutex_lock(&img->lock);
                r = chunk_punch_locked(img, idx);
                pthread_mutex_unlock(&img->lock);
                /* In the trace, a chunk punched is a whole-chunk write from the zero tier. */
                if (r < 0)
                        stats_add(&img->src.stats->errors, 1);
                else if (r > 0)
                        account(img, idx, TRACE_WRITE, STATS_TIER_ZERO, idx * img->chunk_size, length_of(img, idx));
        }
        if (r >= 0)
                r = zero_piece(img, last * img->chunk_size > head_end ? last * img->chunk_size : head_end, end);
        return r;
}

/* --- flushing --------------------------------------------------------------------------------------- */

typedef struct FlushItem {
        uint64_t idx;
        uint32_t gen;
        uint8_t *data;
        bool reserved;                     /* holds room for its object (from the chunk, or reserved by the flush) */
        bool spent;                        /* that room went to writing the object (cache_batch_add_reserved()) */
} FlushItem;

/*
 * After a batch, for the chunks that are still dirty (written again meanwhile, or the flush failed): room
 * for their next flush.  The room an item still holds stays with its chunk; a chunk whose room went to an
 * object reserves again, without evicting for it if there is none (its next flush tries again).  With the
 * flush lock held: no other flush changes the reservations meanwhile.
 */
static void reservations_settle(Image *img, FlushItem *items, size_t n) {
        for (size_t i = 0; i < n; i++) {
                Chunk *c = &img->chunks[items[i].idx];
                bool again;

                pthread_mutex_lock(&img->lock);
                again = c->dirty && !(items[i].reserved && !items[i].spent);
                if (c->dirty)
                        c->reserved = !again;
                pthread_mutex_unlock(&img->lock);
                if (again && cache_reserve(img->src.cache, img->object_max) >= 0) {
                        pthread_mutex_lock(&img->lock);
                        if (c->dirty && !c->reserved)
                                c->reserved = true;
                        else
                                cache_unreserve(img->src.cache, img->object_max);
                        pthread_mutex_unlock(&img->lock);
                }
        }
}

/* Encodes, stores and records one batch; then marks the chunks clean that were not written meanwhile. */
static int flush_batch(Image *img, FlushItem *items, size_t n) {
        KeyringChange *changes = NULL;
        CacheBatch *batch = NULL;
        uint8_t *object = NULL;
        int r;

        changes = calloc(n, sizeof(*changes));
        object = malloc(chunk_object_max_len(img->chunk_size));
        if (!changes || !object) {
                r = -ENOMEM;
                goto out;
        }
        r = cache_batch_new(img->src.cache, true, &batch);
        if (r < 0)
                goto out;
        /* All-zero chunks lose their record and store nothing.  The others that went dirty without room
         * (full_waits, or punched and written again) need it now, before any work. */
        for (size_t i = 0; i < n; i++) {
                changes[i].record.idx = items[i].idx;
                changes[i].remove = chunk_is_zero(items[i].data, length_of(img, items[i].idx));
                if (items[i].reserved || changes[i].remove)
                        continue;
                r = cache_reserve(img->src.cache, img->object_max);
                if (r < 0) {
                        log_warning("failed to flush %s chunk %llu: %s", img->name,
                                    (unsigned long long) items[i].idx,
                                    is_full(r) ? "the cache has no room for it" : strerror(-r));
                        goto out;
                }
                items[i].reserved = true;
        }
        for (size_t i = 0; i < n; i++) {
                size_t len = length_of(img, items[i].idx), object_len = 0;
                uint8_t key[IMAGE_KEY_LEN];
                KeyringChange *ch = &changes[i];

                if (ch->remove)
                        continue;
                r = chunk_encode(items[i].data, len, img->src.secret, COMPRESS_LEVEL_DEFAULT, object, &object_len,
                                 ch->record.tag, key, &ch->record.flags);
                if (r >= 0)
                        r = keyring_wrap_key(img->src.parcel_key, key, ch->record.wkey);
                crypto_wipe(key, sizeof(key));
                if (r >= 0) {
                        r = cache_batch_add_reserved(batch, ch->record.tag, object, object_len, img->object_max);
                        items[i].spent = true;
                }
                if (r < 0) {
                        log_error("failed to flush %s chunk %llu: %s", img->name, (unsigned long long) items[i].idx,
                                  strerror(-r));
                        goto out;
                }
        }
        /* Objects first, durable; only then the records that name them. */
        r = cache_batch_commit(batch);
        if (r < 0)
                goto out;
        pthread_mutex_lock(&img->db_lock);
        r = keyring_apply(img->keyring, changes, n);
        pthread_mutex_unlock(&img->db_lock);
        if (r < 0)
                goto out;

        pthread_mutex_lock(&img->lock);
        for (size_t i = 0; i < n; i++) {
                uint64_t idx = items[i].idx;
                Chunk *c = &img->chunks[idx];

                if (changes[i].remove) {
                        img->n_records -= img->present[idx];
                        img->present[idx] = false;
                } else {
                        img->n_records += !img->present[idx];
                        img->present[idx] = true;
                        img->records[idx] = changes[i].record;
                }
                if (c->gen == items[i].gen && c->dirty) {
                        c->dirty = false;
                        img->dirty_bytes -= length_of(img, idx);
                        img->dirty_chunks--;
                        lru_append(img, (int64_t) idx);
                        /* Clean: its room went to its object, or (all zeros) is not needed. */
                        if (items[i].reserved && !items[i].spent)
                                cache_unreserve(img->src.cache, img->object_max);
                        c->reserved = c->zeroed = false;
                        items[i].reserved = items[i].spent = false;
                }
        }
        img->flush_error = 0;
        evict_locked(img);
        pthread_cond_broadcast(&img->cond);
        pthread_mutex_unlock(&img->lock);
        stats_add(&img->src.stats->chunks_flushed, n);

out:
        cache_batch_free(batch);
        free(object);
        free(changes);
        reservations_settle(img, items, n);
        return r;
}

typedef enum FlushMode {
        FLUSH_EXPLICIT,                    /* image_flush(): everything dirty at the call, partial chunks fetched */
        FLUSH_BACKGROUND,                  /* the flusher: partial chunks only once their objects are here */
        FLUSH_LOCAL,                       /* at exit: nothing fetched; partial chunks whose object is not here stay */
} FlushMode;

/*
 * With the lock held, before a flush that completes partial chunks: asks again, at `priority`, for the objects
 * of those not in the cache (each was asked for at hoard priority when it started), all at once so that their
 * round trips overlap; the completions join these transfers.
 */
static void partials_ask_locked(Image *img, FetchPriority priority) {
        for (uint64_t idx = 0, seen = 0; idx < img->n_chunks && seen < img->partial_chunks; idx++) {
                KeyringRecord rec;

                if (img->chunks[idx].state != CHUNK_PARTIAL)
                        continue;
                seen++;
                rec = img->records[idx];
                if (!cache_has(img->src.cache, rec.tag))
                        prefetch(img, &rec, priority);
        }
}

static int flush_dirty(Image *img, FlushMode mode) {
        uint64_t *dirty = NULL, n_dirty = 0, left = 0;
        FetchPriority priority = mode == FLUSH_EXPLICIT ? FETCH_DEMAND : FETCH_IDLE;
        bool complete = mode == FLUSH_EXPLICIT;
        int r = 0;

        pthread_mutex_lock(&img->flush_lock);
        pthread_mutex_lock(&img->lock);
        /* Dirty chunks press on RAM (writers wait at 3/4 of it): the flusher asks for the partial chunks'
         * objects at hoard priority, and completes them itself only if they alone fill 1/4 of it.  The others
         * are flushed first: completing partial chunks one after another while the guest's writes wait for
         * room slowed its workload at 10 Mbit/s from 12 s to 19-23 s. */
        if (mode == FLUSH_BACKGROUND && img->dirty_bytes > img->ram_limit / 4) {
                priority = FETCH_HOARD;
                complete = img->partial_chunks * img->chunk_size > img->ram_limit / 4;
        }
        if (img->partial_chunks > 0 && priority != FETCH_IDLE)
                partials_ask_locked(img, priority);
        if (img->dirty_chunks > 0) {
                dirty = malloc(img->dirty_chunks * sizeof(*dirty));
                if (!dirty) {
                        pthread_mutex_unlock(&img->lock);
                        r = -ENOMEM;
                        goto out;
                }
                for (uint64_t i = 0; i < img->n_chunks && n_dirty < img->dirty_chunks; i++)
                        if (img->chunks[i].dirty)
                                dirty[n_dirty++] = i;
        }
        pthread_mutex_unlock(&img->lock);

        for (uint64_t start = 0; start < n_dirty;) {
                size_t max_items = FLUSH_BATCH_BYTES / img->chunk_size ? FLUSH_BATCH_BYTES / img->chunk_size : 1;
                FlushItem *items = calloc(max_items, sizeof(*items));
                size_t n = 0;

                if (!items) {
                        r = -ENOMEM;
                        goto out;
                }
                pthread_mutex_lock(&img->lock);
                for (; start < n_dirty && n < max_items; start++) {
                        Chunk *c = &img->chunks[dirty[start]];
                        size_t len = length_of(img, dirty[start]);
                        StatsTier tier;

                        if (!c->dirty)
                                continue;
                        /* A partial chunk is whole before its flush: fetched (explicit), or from the cache. */
                        if (c->state != CHUNK_READY && !complete &&
                            !(c->state == CHUNK_PARTIAL && cache_has(img->src.cache, img->records[dirty[start]].tag))) {
                                left++;
                                continue;
                        }
                        if (c->state == CHUNK_PARTIAL)
                                r = partial_complete_locked(img, dirty[start], priority, &tier);
                        else if (c->state != CHUNK_READY)
                                r = chunk_ready_locked(img, dirty[start], false, &tier);
                        if (r < 0)
                                break;
                        if (!c->dirty)
                                continue;
                        items[n].data = malloc(len);
                        if (!items[n].data)
                                break;
                        memcpy(items[n].data, c->data, len);
                        items[n].idx = dirty[start];
                        items[n].gen = c->gen;
                        items[n].reserved = c->reserved;
                        n++;
                }
                pthread_mutex_unlock(&img->lock);
                if (r >= 0 && n > 0)
                        r = flush_batch(img, items, n);
                for (size_t i = 0; i < n; i++) {
                        crypto_wipe(items[i].data, length_of(img, items[i].idx));
                        free(items[i].data);
                }
                free(items);
                if (r < 0) {
                        pthread_mutex_lock(&img->lock);
                        img->flush_error = r;
                        pthread_cond_broadcast(&img->cond);
                        pthread_mutex_unlock(&img->lock);
                        goto out;
                }
        }
        /* Everything dirty at the call is durable now (or there was nothing, or it waits for its object): no
         * failure stands. */
        pthread_mutex_lock(&img->lock);
        img->flush_error = 0;
        pthread_mutex_unlock(&img->lock);
        stats_add(&img->src.stats->flushes, 1);
        if (mode == FLUSH_LOCAL && left > 0)
                log_warning("%s: %llu chunks written before their objects came are not flushed: their objects are "
                            "not at this site", img->name, (unsigned long long) left);
out:
        free(dirty);
        pthread_mutex_unlock(&img->flush_lock);
        return r;
}

int image_flush(Image *img) {
        return flush_dirty(img, FLUSH_EXPLICIT);
}

int image_flush_local(Image *img) {
        return flush_dirty(img, FLUSH_LOCAL);
}

void image_flush_hold(Image *img) {
        pthread_mutex_lock(&img->flush_lock);
}

void image_flush_release(Image *img) {
        pthread_mutex_unlock(&img->flush_lock);
}

static void *flusher_thread(void *userdata) {
        Image *img = userdata;
        int r;

        pthread_mutex_lock(&img->lock);
        while (!img->stopping) {
                struct timespec deadline;

                if (!img->flush_wanted) {
                        deadline = realtime_after_ns((uint64_t) img->flush_interval_ms * 1000000ULL);
                        pthread_cond_timedwait(&img->flusher_cond, &img->lock, &deadline);
                }
                if (img->stopping)
                        break;
                img->flush_wanted = false;
                if (img->dirty_chunks == 0)
                        continue;
                pthread_mutex_unlock(&img->lock);
                r = flush_dirty(img, FLUSH_BACKGROUND);
                if (is_full(r) && img->src.make_room)
                        img->src.make_room(img->src.make_room_data, false);
                if (r < 0) {
                        /* Do not spin on a persistent failure (a full disk): the next kick or tick retries. */
                        struct timespec pause = { 1, 0 };

                        nanosleep(&pause, NULL);
                }
                pthread_mutex_lock(&img->lock);
        }
        pthread_mutex_unlock(&img->lock);
        return NULL;
}

/* --- life cycle ------------------------------------------------------------------------------------- */

static int records_load(Image *img) {
        KeyringIterator *it = NULL;
        KeyringRecord rec;
        int r;

        r = keyring_iterator_new(img->keyring, &it);
        if (r < 0)
                return r;
        while ((r = keyring_iterator_next(it, &rec)) > 0) {
                img->records[rec.idx] = rec;
                img->present[rec.idx] = true;
                img->n_records++;
        }
        keyring_iterator_free(it);
        return r;
}

int image_open(const char *name, const char *keyring_path, const ImageSources *sources, uint64_t ram_limit,
               unsigned flush_interval_ms, Image **ret) {
        Image *img;
        int r;

        img = calloc(1, sizeof(*img));
        if (!img)
                return -ENOMEM;
        pthread_mutex_init(&img->lock, NULL);
        pthread_mutex_init(&img->db_lock, NULL);
        pthread_mutex_init(&img->flush_lock, NULL);
        pthread_cond_init(&img->cond, NULL);
        pthread_cond_init(&img->flusher_cond, NULL);
        pthread_cond_init(&img->ra_cond, NULL);
        img->src = *sources;
        img->lru_head = img->lru_tail = NO_CHUNK;
        img->flush_interval_ms = flush_interval_ms ? flush_interval_ms : 5000;
        img->name = strdup(name);
        if (!img->name) {
                r = -ENOMEM;
                goto out_free;
        }
        r = keyring_open(keyring_path, &img->keyring);
        if (r < 0)
                goto out_free;
        r = keyring_state_init(img->keyring);
        if (r < 0)
                goto out_free;
        img->chunk_size = keyring_chunk_size(img->keyring);
        img->size = keyring_image_size(img->keyring);
        img->object_max = chunk_object_max_len(img->chunk_size);
        img->n_chunks = chunk_count(img->size, img->chunk_size);
        /* At least a few chunks, so that one read-modify-write never waits for itself. */
        img->ram_limit = ram_limit > (uint64_t) img->chunk_size * 8 ? ram_limit : (uint64_t) img->chunk_size * 8;

        img->present = calloc(img->n_chunks ? img->n_chunks : 1, sizeof(*img->present));
        img->records = calloc(img->n_chunks ? img->n_chunks : 1, sizeof(*img->records));
        img->chunks = calloc(img->n_chunks ? img->n_chunks : 1, sizeof(*img->chunks));
        img->warmed = calloc(img->n_chunks ? img->n_chunks : 1, sizeof(*img->warmed));
        img->pack_warmed = calloc(img->n_chunks ? img->n_chunks : 1, sizeof(*img->pack_warmed));
        if (!img->present || !img->records || !img->chunks || !img->warmed || !img->pack_warmed) {
                r = -ENOMEM;
                goto out_free;
        }
        r = keyring_kw_derive(img->src.parcel_key, img->kw);
        if (r < 0)
                goto out_free;
        img->zeros = calloc(1, img->chunk_size);
        if (!img->zeros) {
                r = -ENOMEM;
                goto out_free;
        }
        r = bufpool_new(img->chunk_size, &img->chunk_pool);
        if (r >= 0)
                r = bufpool_new(chunk_object_max_len(img->chunk_size), &img->object_pool);
        if (r < 0)
                goto out_free;
        for (uint64_t i = 0; i < img->n_chunks; i++)
                img->chunks[i].lru_prev = img->chunks[i].lru_next = NO_CHUNK;
        r = records_load(img);
        if (r < 0)
                goto out_free;

        r = -pthread_create(&img->flusher, NULL, flusher_thread, img);
        if (r < 0)
                goto out_free;
        img->flusher_started = true;

        /* A quarter of the RAM bound at most, so that readahead never pushes out what is being read. */
        img->ra_window = (READAHEAD_BYTES < img->ram_limit / 4 ? READAHEAD_BYTES : img->ram_limit / 4) /
                         img->chunk_size;
        for (; img->ra_window > 0 && img->ra_started < READAHEAD_WORKERS; img->ra_started++) {
                r = -pthread_create(&img->ra_workers[img->ra_started], NULL, readahead_thread, img);
                if (r < 0)
                        goto out_free;
        }
        *ret = img;
        return 0;

out_free:
        image_free(img);
        return r;
}

Image *image_free(Image *img) {
        if (!img)
                return NULL;
        pthread_mutex_lock(&img->lock);
        img->stopping = true;
        pthread_cond_signal(&img->flusher_cond);
        pthread_cond_broadcast(&img->ra_cond);
        pthread_mutex_unlock(&img->lock);
        if (img->flusher_started)
                pthread_join(img->flusher, NULL);
        for (size_t i = 0; i < img->ra_started; i++)
                pthread_join(img->ra_workers[i], NULL);
        if (img->chunks)
                for (uint64_t i = 0; i < img->n_chunks; i++) {
                        chunk_data_release(img, i, img->chunks[i].data);
                        free(img->chunks[i].written);
                }
        bufpool_free(img->object_pool);
        bufpool_free(img->chunk_pool);
        free(img->zeros);
        crypto_wipe(img->kw, sizeof(img->kw));
        for (size_t i = 0; i < img->n_packs; i++) {
                crypto_wipe(img->packs[i].payload, img->packs[i].len);
                free(img->packs[i].payload);
                free(img->packs[i].extents);
        }
        free(img->pack_map);
        free(img->chunks);
        free(img->records);
        free(img->present);
        free(img->warmed);
        free(img->pack_warmed);
        keyring_free(img->keyring);
        pthread_cond_destroy(&img->flusher_cond);
        pthread_cond_destroy(&img->ra_cond);
        pthread_cond_destroy(&img->cond);
        pthread_mutex_destroy(&img->flush_lock);
        pthread_mutex_destroy(&img->db_lock);
        pthread_mutex_destroy(&img->lock);
        free(img->name);
        free(img);
        return NULL;
}

int image_chunk_tag(Image *img, uint64_t idx, uint8_t ret_tag[IMAGE_TAG_LEN]) {
        int r = -ENOENT;

        if (idx >= img->n_chunks)
                return -EINVAL;
        pthread_mutex_lock(&img->lock);
        if (img->present[idx]) {
                memcpy(ret_tag, img->records[idx].tag, IMAGE_TAG_LEN);
                r = 0;
        }
        pthread_mutex_unlock(&img->lock);
        return r;
}

int image_uploads_next(Image *img, uint8_t (*ret_tags)[IMAGE_TAG_LEN], size_t max, size_t *ret_n) {
        int r;

        pthread_mutex_lock(&img->db_lock);
        r = keyring_uploads_next(img->keyring, ret_tags, max, ret_n);
        pthread_mutex_unlock(&img->db_lock);
        return r;
}

int image_uploads_done(Image *img, const uint8_t (*tags)[IMAGE_TAG_LEN], size_t n) {
        int r;

        pthread_mutex_lock(&img->db_lock);
        r = keyring_uploads_done(img->keyring, tags, n);
        pthread_mutex_unlock(&img->db_lock);
        /* The server has them now (or nobody needs them): the cache may evict them.  The other image may
         * still name the same object (convergent encryption); its pin is the same row, so it is
         * restored at the next start if that upload is still pending. */
        if (r >= 0)
                cache_unpin(img->src.cache, tags, n);
        return r;
}

int image_pending_uploads(Image *img, uint8_t (**ret_tags)[IMAGE_TAG_LEN], size_t *ret_n) {
        uint8_t (*tags)[IMAGE_TAG_LEN] = NULL;
        uint64_t changed = 0, pending = 0;
        size_t n = 0;
        int r;

        pthread_mutex_lock(&img->db_lock);
        r = keyring_state_counts(img->keyring, &changed, &pending);
        if (r >= 0 && pending > 0) {
                tags = malloc(pending * sizeof(*tags));
                r = tags ? keyring_uploads_next(img->keyring, tags, pending, &n) : -ENOMEM;
        }
        pthread_mutex_unlock(&img->db_lock);
        if (r < 0) {
                free(tags);
                return r;
        }
        *ret_tags = tags;
        *ret_n = n;
        return 0;
}

int image_record_tags(Image *img, uint8_t (**ret_tags)[IMAGE_TAG_LEN], size_t *ret_n) {
        uint8_t (*tags)[IMAGE_TAG_LEN] = NULL;
        size_t n = 0;
        bool failed;

        pthread_mutex_lock(&img->lock);
        if (img->n_records > 0) {
                tags = malloc(img->n_records * sizeof(*tags));
                for (uint64_t i = 0; tags && i < img->n_chunks && n < img->n_records; i++)
                        if (img->present[i])
                                memcpy(tags[n++], img->records[i].tag, IMAGE_TAG_LEN);
        }
        failed = img->n_records > 0 && !tags;
        pthread_mutex_unlock(&img->lock);
        if (failed)
                return -ENOMEM;
        *ret_tags = tags;
        *ret_n = n;
        return 0;
}

int image_uploads_clear(Image *img) {
        uint8_t (*tags)[IMAGE_TAG_LEN] = NULL;
        size_t n = 0;
        int r;

        r = image_pending_uploads(img, &tags, &n);
        if (r >= 0 && n > 0)
                r = image_uploads_done(img, (const uint8_t (*)[IMAGE_TAG_LEN]) tags, n);
        free(tags);
        return r;
}

void image_set_full_waits(Image *img, bool waits) {
        pthread_mutex_lock(&img->lock);
        img->full_waits = waits;
        pthread_mutex_unlock(&img->lock);
}

void image_set_partial_writes(Image *img, uint32_t unit) {
        pthread_mutex_lock(&img->lock);
        /* A chunk no larger than a unit is written whole or read first anyway.  Chunk sizes are powers of
         * two, so a smaller power of two divides each chunk (the last may be short). */
        img->partial_unit = unit && !(unit & (unit - 1)) && unit < img->chunk_size ? unit : 0;
        pthread_mutex_unlock(&img->lock);
}

int image_changed_reset(Image *img) {
        int r;

        pthread_mutex_lock(&img->db_lock);
        r = keyring_changed_reset(img->keyring);
        pthread_mutex_unlock(&img->db_lock);
        return r;
}

void image_status(Image *img, ImageStatus *ret) {
        memset(ret, 0, sizeof(*ret));
        pthread_mutex_lock(&img->lock);
        ret->size = img->size;
        ret->chunk_size = img->chunk_size;
        ret->chunks = img->n_chunks;
        ret->records = img->n_records;
        ret->ram_bytes = img->ram_bytes;
        ret->dirty_chunks = img->dirty_chunks;
        ret->flush_error = img->flush_error;
        ret->pack_bytes = img->pack_bytes;
        ret->pack_parts = img->n_packs;
        ret->pack_waits = img->pack_waits;
        ret->pack_wait_ms = img->pack_wait_ns / 1000000;
        ret->dirty_bytes = img->dirty_bytes;
        ret->partial_chunks = img->partial_chunks;
        ret->warmed_chunks = img->warmed_chunks;
        ret->warm_bytes = img->warm_bytes;
        for (uint64_t i = 0, seen = 0; i < img->n_chunks && seen < img->dirty_chunks; i++)
                if (img->chunks[i].dirty) {
                        seen++;
                        ret->unreserved_chunks += !img->chunks[i].reserved && !img->chunks[i].zeroed;
                }
        pthread_mutex_unlock(&img->lock);
        pthread_mutex_lock(&img->db_lock);
        keyring_state_counts(img->keyring, &ret->changed_chunks, &ret->pending_uploads);
        pthread_mutex_unlock(&img->db_lock);
}

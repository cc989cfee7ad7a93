/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "cache.h"
#include "fetch.h"
#include "lookaside.h"
#include "pack.h"
#include "stats.h"
#include "trace.h"

#define IMAGE_TAG_LEN 32
#define IMAGE_KEY_LEN 32

/* Where an image's chunks come from, and the keys to open and make them; shared by both images. */
typedef struct ImageSources {
        Cache *cache;
        Lookaside *lookaside;          /* may be NULL */
        Fetcher *fetcher;              /* may be NULL: no server, a miss everywhere else is definitive */
        Stats *stats;
        Trace *trace;
        const uint8_t *parcel_key;     /* IMAGE_KEY_LEN bytes, wraps chunk keys */
        const uint8_t *secret;         /* IMAGE_KEY_LEN bytes, the convergence secret */
        /* Called without locks when a write (flush: also flush dirty chunks, which gives back the room they
         * hold beyond what their objects take) or a flush found no room in the cache (may be NULL). */
        int (*make_room)(void *userdata, bool flush);
        void *make_room_data;
} ImageSources;

typedef struct ImageStatus {
        uint64_t size;
        uint32_t chunk_size;
        uint64_t chunks;               /* chunks in the image */
        uint64_t records;              /* chunks with a keyring record (not all zeros) */
        uint64_t ram_bytes;            /* plaintext held in RAM */
        uint64_t dirty_chunks;         /* modified in RAM, not yet durable */
        uint64_t changed_chunks;       /* changed since the base version (durable) */
        uint64_t pending_uploads;      /* objects the server may not have yet */
        int flush_error;               /* last background flush failure (negative errno) or 0 */
        uint64_t pack_bytes;           /* plaintext in the resume pack (image_preload) */
        uint64_t pack_parts;           /* its parts here */
        uint64_t pack_waits;           /* reads that waited for a part on its way, and for how long in all */
        uint64_t pack_wait_ms;
        uint64_t dirty_bytes;          /* plaintext of the dirty chunks */
        uint64_t unreserved_chunks;    /* dirty chunks without room reserved in the cache (see image_open()) */
        uint64_t partial_chunks;       /* dirty chunks written before their object came (image_set_partial_writes) */
        uint64_t warmed_chunks;        /* handed to the warmer (image_warm_next) */
        uint64_t warm_bytes;           /* served to it (image_warm_read) */
} ImageStatus;

typedef struct Image Image;

/*
 * Opens the image described by the local keyring at keyring_path (chunk and image size come from its
 * meta table) and loads its records.  Plaintext is kept in RAM up to ram_limit bytes (dirty chunks are
 * pinned; writers wait when dirty chunks fill 3/4 of it).  A background thread flushes dirty chunks when
 * they fill 1/4 of it and every flush_interval_ms.
 *
 * Room: a write that makes a chunk dirty first reserves room in the cache for its object
 * (cache_reserve()), so that a flush never fails for lack of space after the write was acknowledged.
 * Without room the write fails with -ENOSPC and changes nothing; with image_set_full_waits() it goes
 * ahead instead (the chunk is dirty without reservation) and writers that the RAM bound holds back wait
 * for room rather than fail: for the memory image, whose writes are the kernel's writeback of a mapping,
 * which must not lose them.
 */
int image_open(const char *name, const char *keyring_path, const ImageSources *sources, uint64_t ram_limit,
               unsigned flush_interval_ms, Image **ret);

/* Stops the background flusher; does not flush (call image_flush() first). */
Image *image_free(Image *img);

void image_set_full_waits(Image *img, bool waits);

/*
 * Whether a write of whole units of `unit` bytes (a power of two below the chunk size; else off) to a chunk
 * that is not at this site (neither in RAM nor in the cache, and no lookaside source) goes ahead without
 * waiting for the chunk: the chunk holds the units written, its object is fetched at hoard priority, and a
 * read of its other units or a flush merges them in (image.c, "partial chunks").  vulpes sets it on both
 * images (the memory image's writes are the kernel's writeback of QEMU's mapping of it, in pages; the disk's
 * are the guest's block writes, in sectors): an explicit flush (image_flush()) then needs the server for such
 * chunks, as their reads would.
 */
void image_set_partial_writes(Image *img, uint32_t unit);

const char *image_name(const Image *img);
uint64_t image_size(const Image *img);
uint32_t image_chunk_size(const Image *img);
uint64_t image_chunk_count(const Image *img);

/*
 * Reads or writes len bytes at offset (clipped at the image's end; -EINVAL beyond it).  Returns the byte
 * count or a negative errno: -EIO only for a definitive failure (the chunk exists nowhere, or every copy
 * failed verification), after one log line that names the chunk.  Transient network trouble blocks.
 */
ssize_t image_read(Image *img, void *buf, size_t len, uint64_t offset);
ssize_t image_write(Image *img, const void *buf, size_t len, uint64_t offset);

/*
 * Makes [offset, offset + len) read as zeros (clipped at the image's end), for fallocate's PUNCH_HOLE and
 * ZERO_RANGE.  Whole chunks in the range are not read: they become dirty zeros, so their flush drops
 * their records (an all-zero chunk has none; nothing is stored, uploaded or fetched for it).  The pieces
 * of chunks at either edge are written as zeros like any write.  Durable like a write: at the next
 * image_flush().  Returns 0 or a negative errno (as image_write(); a failure part-way leaves a prefix
 * zeroed).
 */
int image_punch(Image *img, uint64_t offset, uint64_t len);

/*
 * image_read() without the copy, for a caller that hands the bytes on (FUSE replies with the RAM cache's
 * own memory): fills iov[0..*ret_n) with pieces that cover the bytes read, each a pointer into a chunk in
 * RAM, pinned so that it stays there, or to zeros.  Returns the byte count (short only at the image's end) or
 * a negative errno: a read that fails part-way fails whole, its pieces pinned so far still in iov[0..*ret_n).
 * The pieces stay valid until image_read_release() with the same offset, also after a failure;
 * concurrent writes to the same bytes may show through, as with image_read().  max_iov must be at least
 * image_read_pieces_max(img, len).
 */
size_t image_read_pieces_max(const Image *img, size_t len);
ssize_t image_read_pin(Image *img, size_t len, uint64_t offset, struct iovec *iov, size_t max_iov, size_t *ret_n);
void image_read_release(Image *img, const struct iovec *iov, size_t n, uint64_t offset);

/*
 * For the warmer (warm.c), which fills the kernel's page cache of the memory mount ahead of the guest.
 *
 * image_traced_reads(): the reads of this image traced so far (each guest page fault through the memory mount
 * is one).  image_warm_next(): the first chunk from *cursor on (which it advances) that was not handed out
 * since it last changed under the kernel (a punch), and is here: in RAM or the cache (only RAM with
 * IMAGE_WARM_RAM_ONLY), or with IMAGE_WARM_ZEROS, a chunk without record (zeros, not in RAM); it is marked
 * warmed; -ENOENT at the image's end.
 * image_warmed(): whether chunk idx was.  image_warm_read(): image_read() for the warmer's own requests: not
 * traced or counted as reads, never fetches, loads nothing into RAM; a read of anything it cannot serve from
 * RAM, zeros or the cache fails whole (-EAGAIN), never short.
 */
uint64_t image_traced_reads(Image *img);
enum {
        IMAGE_WARM_ZEROS = 1 << 0,         /* image_warm_next(): chunks without record instead of those with data */
        IMAGE_WARM_RAM_ONLY = 1 << 1,      /* ... only those in RAM (no look into the cache) */
};
int image_warm_next(Image *img, uint64_t *cursor, unsigned flags, uint64_t *ret_idx);
/* image_warm_pack_next(): the next extent of the resume pack's parts here from *cursor on (0 at first; it only
 * goes forward, as parts come), whose chunks then count as warmed for image_warmed(); -ENOENT for now. */
int image_warm_pack_next(Image *img, uint64_t *cursor, uint64_t *ret_offset, uint64_t *ret_len);
bool image_warmed(Image *img, uint64_t idx);
/* Traces a read of [offset, offset + length) with source `mapped`: a page the guest touched without a read
 * (warm_trace_mapped()). */
void image_trace_mapped(Image *img, uint64_t offset, size_t length);
ssize_t image_warm_read(Image *img, void *buf, size_t len, uint64_t offset);

/*
 * Takes part `part` of this image's resume pack (its payload, vulpes/src/pack.h, malloc()ed; owned by the
 * image from then on, wiped when it is freed): reads of bytes a part holds, in chunks that are not in RAM and
 * have not been written since, are served from it without loading the chunk.  Parts may come while the guest
 * runs, in any order, each once (-EBUSY for a part already here; -EINVAL for an index of IMAGE_PACKS_MAX or
 * more); -EBADMSG if the payload is not a pack for this image (then the caller keeps it).  The first part with
 * a map makes reads of the bytes it puts in a part soon to come wait for that part (image.c, PACK_WAIT_PARTS)
 * until image_preload_end().
 */
#define IMAGE_PACKS_MAX PACK_PARTS_MAX
int image_preload(Image *img, uint8_t *payload, size_t len, uint32_t part);
/*
 * No more parts will come: no read waits for one any more.  `rate` (bytes/s, 0: not known) is what the link
 * carried while the parts came (the fetcher's peak rate is at least that).  On a link whose bandwidth-delay
 * product holds a whole chunk (fetch_bdp_bytes()), the chunks that hold the pack's pages and are not here are
 * asked for, in the pack's order, at FETCH_SOON.
 */
void image_preload_end(Image *img, uint64_t rate);

/*
 * Makes every write acknowledged before the call durable: dirty chunks are re-encoded (new convergent
 * key and tag), written to the cache (temporary files, sync, rename, sync) and then recorded in the local
 * keyring in one transaction.  All-zero chunks lose their record instead.  Partial chunks
 * (image_set_partial_writes()) are completed first, their objects fetched if they are not in the cache.
 */
int image_flush(Image *img);

/* image_flush() without fetching: partial chunks whose object is not in the cache stay dirty in RAM (with a
 * warning).  At exit, which must not wait for a server. */
int image_flush_local(Image *img);

/* Hold off every flush of img (its flush lock), e.g. while the cache's pins are replaced. */
void image_flush_hold(Image *img);
void image_flush_release(Image *img);

/* The tag of chunk idx, or -ENOENT for a chunk without record (all zeros). */
int image_chunk_tag(Image *img, uint64_t idx, uint8_t ret_tag[IMAGE_TAG_LEN]);

/* Upload bookkeeping for writeback.c, see keyring_uploads_next(). */
int image_uploads_next(Image *img, uint8_t (*ret_tags)[IMAGE_TAG_LEN], size_t max, size_t *ret_n);
int image_uploads_done(Image *img, const uint8_t (*tags)[IMAGE_TAG_LEN], size_t n);

/* Every pending upload's tag (malloc()ed; NULL when there is none), for the cache's pins. */
int image_pending_uploads(Image *img, uint8_t (**ret_tags)[IMAGE_TAG_LEN], size_t *ret_n);

/* Every record's tag (malloc()ed; NULL when there is none): what a disconnected session must keep. */
int image_record_tags(Image *img, uint8_t (**ret_tags)[IMAGE_TAG_LEN], size_t *ret_n);

/* After a checkin: the server has every object the keyring names; forget and unpin every pending upload. */
int image_uploads_clear(Image *img);

/* Forget which chunks changed: the current keyring is now the base version (after a checkin). */
int image_changed_reset(Image *img);

void image_status(Image *img, ImageStatus *ret);

/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "fetch.h"
#include "hoard.h"
#include "image.h"
#include "stats.h"
#include "trace.h"
#include "writeback.h"

#define DAEMON_KEYS_LEN 64     /* parcel key || convergence secret */

typedef enum DaemonImage {
        DAEMON_IMAGE_DISK,
        DAEMON_IMAGE_MEMORY,
        _DAEMON_IMAGE_MAX,
} DaemonImage;

/* Everything main.c parsed; defaults are applied by daemon_new(). */
typedef struct DaemonConfig {
        const char *state_dir;          /* keyring.disk, keyring.memory, hoard state */
        const char *cache_dir;
        const char *server_url;         /* NULL: no server */
        const char *token_file;
        const char *ca_file;
        const char *pinned_key;
        const char *const *lookaside;
        size_t n_lookaside;
        const char *trace_path;
        bool offline;
        uint64_t ram_cache_bytes;       /* per image */
        uint64_t cache_limit_bytes;     /* the shared cache's size limit, 0: none */
        unsigned flush_interval_ms;
        unsigned max_transfers;
        unsigned hoard_window;
        uint8_t keys[DAEMON_KEYS_LEN];
} DaemonConfig;

typedef struct Daemon Daemon;

int daemon_new(const DaemonConfig *config, Daemon **ret);

/* Flushes both images (making every acknowledged write durable), stops every thread, wipes the keys. */
Daemon *daemon_free(Daemon *d);
/*
 * Stops the hoard and writeback workers (a hoard request stays remembered).  At shutdown this comes before
 * the control socket closes: a control request that waits on them (an upload that the server keeps
 * refusing) then ends, instead of holding the shutdown forever.
 */
void daemon_halt(Daemon *d);

Image *daemon_image(Daemon *d, DaemonImage id);
const char *daemon_image_name(DaemonImage id);
Hoard *daemon_hoard(Daemon *d);              /* NULL without a server */
Writeback *daemon_writeback(Daemon *d);      /* NULL without a server */
Trace *daemon_trace(Daemon *d);
Cache *daemon_cache(Daemon *d);

/* Continues a remembered hoard request; call once the daemon serves. */
int daemon_start_background(Daemon *d);

int daemon_flush(Daemon *d);
/* Room held for nothing given back: dirty chunks flushed (with flush), stale pins dropped. */
int daemon_room_reclaim(Daemon *d, bool flush);
int daemon_set_offline(Daemon *d, bool offline);

/* The mounts that serve the images (the main one, the memory mount): each drops the kernel's cached pages
 * of an image when asked (daemon_invalidate()), so that the next accesses fault again and reach the trace;
 * and the memory mount's warmer (warm.c), which stops for good first.  Called in the order added. */
enum { DAEMON_INVALIDATORS_MAX = 3 };
typedef int (*DaemonInvalidator)(void *arg, DaemonImage id);
int daemon_add_invalidator(Daemon *d, DaemonInvalidator fn, void *arg);
/* Drops the kernel's cached pages of image `id` on every mount (dirty ones are written back first, as
 * ordinary writes); -ENOTSUP with no mount. */
int daemon_invalidate(Daemon *d, DaemonImage id);
/* The warmer's warm_trace_mapped(): traces the pages of warmed chunks process `pid` has mapped; the number
 * traced, or -ENOTSUP without a warmer. */
typedef int (*DaemonMappedTracer)(void *arg, pid_t pid);
void daemon_set_mapped_tracer(Daemon *d, DaemonMappedTracer fn, void *arg);
int daemon_trace_mapped(Daemon *d, pid_t pid);
int daemon_trace_start(Daemon *d, const char *path);

/* The full status report as a JSON object (malloc()ed text): images, I/O, tiers, fetch latency,
 * network state, cache, hoard progress, writeback, trace. */
int daemon_status_json(Daemon *d, char **ret_text, size_t *ret_len);

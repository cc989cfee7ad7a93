/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The daemon's parts and their order: statistics, trace, cache, lookaside, fetcher, the two images,
 * hoard and writeback, set up and torn down in one place, plus the status report that the stats file and
 * the control socket serve.
 *
 * Threading: the accessors are safe from any thread; daemon_new() and daemon_free() run alone.
 */
#define _GNU_SOURCE
#include "daemon.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crypto.h"
#include "log.h"

struct Daemon {
        Stats stats;
        uint8_t keys[DAEMON_KEYS_LEN];
        Trace *trace;
        Cache *cache;
        Lookaside *lookaside;
        Fetcher *fetcher;
        Image *images[_DAEMON_IMAGE_MAX];
        Hoard *hoard;
        Writeback *writeback;
        DaemonInvalidator invalidate[DAEMON_INVALIDATORS_MAX];
        void *invalidate_arg[DAEMON_INVALIDATORS_MAX];
        unsigned n_invalidators;
        DaemonMappedTracer trace_mapped;
        void *trace_mapped_arg;
};

static const char *const image_names[_DAEMON_IMAGE_MAX] = { "disk", "memory" };

const char *daemon_image_name(DaemonImage id) {
        return id < _DAEMON_IMAGE_MAX ? image_names[id] : "?";
}

int daemon_add_invalidator(Daemon *d, DaemonInvalidator fn, void *arg) {
        if (d->n_invalidators == DAEMON_INVALIDATORS_MAX)
                return -ENOSPC;
        d->invalidate[d->n_invalidators] = fn;
        d->invalidate_arg[d->n_invalidators++] = arg;
        return 0;
}

int daemon_invalidate(Daemon *d, DaemonImage id) {
        int r = d->n_invalidators ? 0 : -ENOTSUP;

        for (unsigned k = 0; k < d->n_invalidators && r >= 0; k++)
                r = d->invalidate[k](d->invalidate_arg[k], id);
        return r;
}

void daemon_set_mapped_tracer(Daemon *d, DaemonMappedTracer fn, void *arg) {
        d->trace_mapped = fn;
        d->trace_mapped_arg = arg;
}

int daemon_trace_mapped(Daemon *d, pid_t pid) {
        return d->trace_mapped ? d->trace_mapped(d->trace_mapped_arg, pid) : -ENOTSUP;
}

Image *daemon_image(Daemon *d, DaemonImage id) {
        return d->images[id];
}

Hoard *daemon_hoard(Daemon *d) {
        return d->hoard;
}

Writeback *daemon_writeback(Daemon *d) {
        return d->writeback;
}

Trace *daemon_trace(Daemon *d) {
        return d->trace;
}

Cache *daemon_cache(Daemon *d) {
        return d->cache;
}

/* The tags of every image: its pending uploads, or with records, every record's (malloc()ed). */
static int tags_of_images(Daemon *d, bool records, uint8_t (**ret_tags)[IMAGE_TAG_LEN], size_t *ret_n) {
        uint8_t (*all)[IMAGE_TAG_LEN] = NULL;
        size_t n_all = 0;
        int r = 0;

        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++) {
                uint8_t (*tags)[IMAGE_TAG_LEN] = NULL, (*p)[IMAGE_TAG_LEN];
                size_t n = 0;

                r = records ? image_record_tags(d->images[i], &tags, &n) : image_pending_uploads(d->images[i], &tags, &n);
                if (r < 0)
                        goto out;
                p = n > 0 ? realloc(all, (n_all + n) * sizeof(*all)) : all;
                if (n > 0 && !p) {
                        free(tags);
                        r = -ENOMEM;
                        goto out;
                }
                all = p;
                if (n > 0)
                        memcpy(all + n_all, tags, n * sizeof(*tags));
                n_all += n;
                free(tags);
        }
        *ret_tags = all;
        *ret_n = n_all;
        return 0;
out:
        free(all);
        return r;
}

/*
 * Pins, in the shared cache, exactly the objects of this parcel that the server may not have (its pending
 * uploads, read from the keyrings, which are the truth), replacing whatever this state directory pinned
 * before: a crash can leave stale pins, a damaged index loses them.  The owner is the state directory's
 * real path, so every vulpes of the parcel is the same owner.  Without a server (disconnected operation)
 * every object the keyrings name is pinned too, as owner "<path>#disconnected": nothing could fetch it
 * again, so no writer may evict it to make room; with a server those pins are dropped.
 */
static int cache_pins_restore(Daemon *d, const char *state_dir, bool disconnected) {
        uint8_t (*tags)[IMAGE_TAG_LEN] = NULL;
        char owner[PATH_MAX], other[PATH_MAX + 16];
        size_t n = 0;
        int r;

        if (!realpath(state_dir, owner))
                snprintf(owner, sizeof(owner), "%s", state_dir);
        r = cache_set_owner(d->cache, owner);
        if (r < 0)
                return r;
        r = tags_of_images(d, false, &tags, &n);
        if (r < 0)
                return r;
        r = cache_pins_replace(d->cache, (const uint8_t (*)[CACHE_TAG_LEN]) tags, n);
        free(tags);
        tags = NULL;
        n = 0;
        if (r < 0)
                return r;
        snprintf(other, sizeof(other), "%s#disconnected", owner);
        if (disconnected) {
                r = tags_of_images(d, true, &tags, &n);
                if (r < 0)
                        return r;
        }
        r = cache_pins_replace_owner(d->cache, other, (const uint8_t (*)[CACHE_TAG_LEN]) tags, n);
        free(tags);
        return r;
}

/* An image's write or flush that found no room (see daemon_room_reclaim()). */
static int make_room(void *userdata, bool flush) {
        return daemon_room_reclaim(userdata, flush);
}

int daemon_new(const DaemonConfig *config, Daemon **ret) {
        char path[PATH_MAX];
        Daemon *d;
        int r;

        d = calloc(1, sizeof(*d));
        if (!d)
                return -ENOMEM;
        memcpy(d->keys, config->keys, DAEMON_KEYS_LEN);

        r = trace_new(&d->trace);
        if (r < 0)
                goto out_free;
        r = cache_open(config->cache_dir, &d->cache);
        if (r < 0)
                goto out_free;
        r = lookaside_new(config->lookaside, config->n_lookaside, &d->stats, &d->lookaside);
        if (r < 0)
                goto out_free;
        if (config->server_url) {
                FetchConfig fc = {
                        .server_url = config->server_url,
                        .token_file = config->token_file,
                        .ca_file = config->ca_file,
                        .pinned_key = config->pinned_key,
                        .max_transfers = config->max_transfers,
                        .offline = config->offline,
                };

                r = fetch_new(&fc, &d->stats, &d->fetcher);
                if (r < 0) {
                        log_error("failed to set up the connection to %s: %s", config->server_url, strerror(-r));
                        goto out_free;
                }
        }

        ImageSources sources = {
                .cache = d->cache,
                .lookaside = config->n_lookaside ? d->lookaside : NULL,   /* none: image.c may prefetch */
                .fetcher = d->fetcher,
                .stats = &d->stats,
                .trace = d->trace,
                .parcel_key = d->keys,
                .secret = d->keys + 32,
                .make_room = make_room,
                .make_room_data = d,
        };
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++) {
                snprintf(path, sizeof(path), "%s/keyring.%s", config->state_dir, image_names[i]);
                r = image_open(image_names[i], path, &sources, config->ram_cache_bytes, config->flush_interval_ms,
                               &d->images[i]);
                if (r < 0) {
                        log_error("failed to open the %s image from %s: %s", image_names[i], path, strerror(-r));
                        goto out_free;
                }
        }
        /* The memory image's writes are the kernel's writeback of QEMU's mapping of it: refused, they would
         * be lost; without room they wait (the session pauses the VM).  The disk's fail with ENOSPC. */
        image_set_full_waits(d->images[DAEMON_IMAGE_MEMORY], true);
        /* Writes of whole pages (memory) or sectors (disk) to a chunk that is not here need not wait for
         * that chunk (image.c, "partial chunks"): the memory image's writeback before each hole QEMU punches
         * covers every dirty page after the hole, and a guest at a fresh site writes its files' blocks (1 KiB
         * in the test guest) into disk chunks it never read (at 100 Mbit/s +20 ms, 52-54 fetches one after
         * another, 1.7 s of a 6.7 s workload).  A flush (the guest's, a suspend's) completes them: what it
         * made durable is whole. */
        image_set_partial_writes(d->images[DAEMON_IMAGE_MEMORY], 4096);      /* a page */
        image_set_partial_writes(d->images[DAEMON_IMAGE_DISK], 512);         /* a sector */
        r = cache_pins_restore(d, config->state_dir, !config->server_url);
        if (r < 0)
                goto out_free;
        r = cache_set_limit(d->cache, config->cache_limit_bytes);
        if (r < 0)
                goto out_free;

        if (d->fetcher) {
                snprintf(path, sizeof(path), "%s/hoard.request", config->state_dir);
                r = hoard_new(d->images, _DAEMON_IMAGE_MAX, d->cache, d->fetcher, path, config->hoard_window,
                              &d->hoard);
                if (r < 0)
                        goto out_free;
                r = writeback_new(d->images, _DAEMON_IMAGE_MAX, d->cache, d->fetcher, &d->writeback);
                if (r < 0)
                        goto out_free;
        }
        if (config->trace_path) {
                r = daemon_trace_start(d, config->trace_path);
                if (r < 0)
                        goto out_free;
        }
        *ret = d;
        return 0;

out_free:
        daemon_free(d);
        return r;
}

void daemon_halt(Daemon *d) {
        if (d->hoard)
                hoard_halt(d->hoard);
        if (d->writeback)
                writeback_halt(d->writeback);
}

Daemon *daemon_free(Daemon *d) {
        if (!d)
                return NULL;
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                if (d->images[i] && image_flush_local(d->images[i]) < 0)
                        log_error("failed to flush the %s image at exit: writes since the last flush are lost",
                                  image_names[i]);
        daemon_halt(d);
        d->fetcher = fetch_free(d->fetcher);
        d->hoard = hoard_free(d->hoard);
        d->writeback = writeback_free(d->writeback);
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                d->images[i] = image_free(d->images[i]);
        d->lookaside = lookaside_free(d->lookaside);
        d->cache = cache_free(d->cache);
        d->trace = trace_free(d->trace);
        crypto_wipe(d->keys, sizeof(d->keys));
        free(d);
        return NULL;
}

int daemon_start_background(Daemon *d) {
        return d->hoard ? hoard_resume(d->hoard) : 0;
}

int daemon_flush(Daemon *d) {
        int r = 0;

        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++) {
                int q = image_flush(d->images[i]);

                if (q < 0 && r == 0)
                        r = q;
        }
        return r;
}

/*
 * Gives back room held for nothing: with flush, the reservations of dirty chunks beyond what their objects
 * take (by flushing them); and the pins of pending uploads that no record names any more (a chunk written
 * again before its upload), which only the pins of this parcel say must stay.  The pins are replaced by
 * the pending uploads with every flush held off: a flush pins its objects before the keyring names them.
 */
int daemon_room_reclaim(Daemon *d, bool flush) {
        uint8_t (*tags)[IMAGE_TAG_LEN] = NULL;
        size_t n = 0;
        int r = 0;

        if (flush)
                r = daemon_flush(d);
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                image_flush_hold(d->images[i]);
        int q = tags_of_images(d, false, &tags, &n);

        if (q >= 0)
                q = cache_pins_replace(d->cache, (const uint8_t (*)[CACHE_TAG_LEN]) tags, n);
        for (int i = _DAEMON_IMAGE_MAX - 1; i >= 0; i--)
                image_flush_release(d->images[i]);
        free(tags);
        return r < 0 ? r : q;
}

int daemon_set_offline(Daemon *d, bool offline) {
        if (!d->fetcher)
                return -ENOTCONN;
        fetch_set_offline(d->fetcher, offline);
        log_info("%s", offline ? "offline: server requests wait" : "online");
        return 0;
}

int daemon_trace_start(Daemon *d, const char *path) {
        uint32_t sizes[_DAEMON_IMAGE_MAX];

        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                sizes[i] = image_chunk_size(d->images[i]);
        return trace_start(d->trace, path, image_names, sizes, _DAEMON_IMAGE_MAX);
}

/* --- status report ---------------------------------------------------------------------------------- */

static void json_string(FILE *f, const char *s) {
        fputc('"', f);
        for (; s && *s; s++) {
                unsigned char c = (unsigned char) *s;

                if (c == '"' || c == '\\')
                        fprintf(f, "\\%c", c);
                else if (c < 0x20)
                        fprintf(f, "\\u%04x", c);
                else
                        fputc(c, f);
        }
        fputc('"', f);
}

#define U(x) ((unsigned long long) (x))

/* A latency histogram's buckets as JSON objects, {"le": bound in µs (null: open), "count": n}. */
static void latency_json(FILE *f, atomic_uint_fast64_t *buckets) {
        for (size_t b = 0; b < STATS_LATENCY_BUCKETS; b++) {
                uint64_t bound = stats_latency_bound(b);

                if (bound == UINT64_MAX)
                        fprintf(f, "%s{\"le\":null,\"count\":%llu}", b ? "," : "", U(stats_get(&buckets[b])));
                else
                        fprintf(f, "%s{\"le\":%llu,\"count\":%llu}", b ? "," : "", U(bound),
                                U(stats_get(&buckets[b])));
        }
}

int daemon_status_json(Daemon *d, char **ret_text, size_t *ret_len) {
        Stats *s = &d->stats;
        char *text = NULL;
        size_t len = 0;
        CacheStatus cs;
        FILE *f;

        f = open_memstream(&text, &len);
        if (!f)
                return -ENOMEM;
        fputs("{\"images\":{", f);
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++) {
                ImageStatus st;

                image_status(d->images[i], &st);
                fprintf(f,
                        "%s\"%s\":{\"size\":%llu,\"chunk_size\":%u,\"chunks\":%llu,\"records\":%llu,\"ram_bytes\":%llu,"
                        "\"dirty_chunks\":%llu,\"changed_chunks\":%llu,\"pending_uploads\":%llu,\"flush_error\":%d,"
                        "\"pack_bytes\":%llu,\"pack_parts\":%llu,\"pack_waits\":%llu,\"pack_wait_ms\":%llu,\"dirty_bytes\":%llu,"
                        "\"unreserved_chunks\":%llu,\"partial_chunks\":%llu,\"warmed_chunks\":%llu,\"warm_bytes\":%llu}",
                        i ? "," : "", image_names[i], U(st.size), st.chunk_size, U(st.chunks), U(st.records),
                        U(st.ram_bytes), U(st.dirty_chunks), U(st.changed_chunks), U(st.pending_uploads),
                        st.flush_error, U(st.pack_bytes), U(st.pack_parts), U(st.pack_waits), U(st.pack_wait_ms),
                        U(st.dirty_bytes), U(st.unreserved_chunks), U(st.partial_chunks), U(st.warmed_chunks),
                        U(st.warm_bytes));
        }
        fprintf(f,
                "},\"io\":{\"bytes_read\":%llu,\"bytes_written\":%llu,\"chunks_read\":%llu,\"chunks_written\":%llu},"
                "\"errors\":%llu,\"misses\":%llu,\"hits\":{",
                U(stats_get(&s->bytes_read)), U(stats_get(&s->bytes_written)), U(stats_get(&s->chunks_read)),
                U(stats_get(&s->chunks_written)), U(stats_get(&s->errors)), U(stats_get(&s->misses)));
        for (int t = 0; t < _STATS_TIER_MAX; t++)
                fprintf(f, "%s\"%s\":%llu", t ? "," : "", stats_tier_name((StatsTier) t), U(stats_get(&s->hits[t])));
        fprintf(f, "},\"fetch\":{\"fetches\":%llu,\"bytes\":%llu,\"retries\":%llu,\"bad\":%llu,\"latency_us\":[",
                U(stats_get(&s->fetches)), U(stats_get(&s->fetch_bytes)), U(stats_get(&s->fetch_retries)),
                U(stats_get(&s->fetch_bad)));
        latency_json(f, s->latency);
        fputs("],\"demand_latency_us\":[", f);
        latency_json(f, s->demand_latency);
        fputs("]", f);
        if (d->fetcher) {
                FetchStatus fs;

                fetch_status(d->fetcher, &fs);
                fprintf(f,
                        ",\"server\":true,\"offline\":%s,\"waiting\":%s,\"waiting_seconds\":%llu,\"queued_demand\":%u,"
                        "\"queued_ahead\":%u,\"queued_soon\":%u,\"queued_hoard\":%u,\"queued_idle\":%u,\"active\":%u,"
                        "\"active_hoard\":%u,\"hoard_limit\":%u,"
                        "\"rtt_min_us\":%llu,\"rate\":%llu,\"rate_peak\":%llu,\"uploads_queued\":%u,\"last_error\":",
                        fs.offline ? "true" : "false", fs.waiting ? "true" : "false", U(fs.waiting_seconds),
                        fs.queued[FETCH_DEMAND], fs.queued[FETCH_AHEAD], fs.queued[FETCH_SOON], fs.queued[FETCH_HOARD],
                        fs.queued[FETCH_IDLE], fs.active, fs.active_hoard, fs.hoard_limit,
                        U(fs.rtt_min_us), U(fs.rate), U(fs.rate_peak), fs.uploads);
                json_string(f, fs.last_error);
        } else {
                fputs(",\"server\":false,\"offline\":true,\"waiting\":false", f);
        }
        cache_status(d->cache, &cs);
        fprintf(f, "},\"cache\":{\"dir\":");
        json_string(f, cache_dir(d->cache));
        fprintf(f, ",\"objects\":%llu,\"bytes\":%llu,\"limit\":%llu,\"evictions\":%llu,\"evictions_total\":%llu,"
                   "\"pinned\":%llu,\"pinned_bytes\":%llu,\"own_pinned_bytes\":%llu,\"reserved\":%llu,"
                   "\"fs_free\":%llu,\"fs_size\":%llu,\"room\":%llu,\"refused\":%llu,"
                   "\"quarantined\":%llu},\"lookaside_bad\":%llu,"
                   "\"flush\":{\"flushes\":%llu,\"chunks\":%llu,\"partial_chunks\":%llu}",
                U(cs.objects), U(cs.bytes), U(cs.limit), U(cs.evictions), U(cs.evictions_total), U(cs.pinned),
                U(cs.pinned_bytes), U(cs.own_pinned_bytes), U(cs.reserved), U(cs.fs_free), U(cs.fs_size),
                U(cs.room), U(cs.refused),
                U(stats_get(&s->quarantined)), U(stats_get(&s->lookaside_bad)),
                U(stats_get(&s->flushes)), U(stats_get(&s->chunks_flushed)), U(stats_get(&s->partial_chunks)));
        if (d->hoard) {
                HoardProgress p;

                hoard_progress(d->hoard, &p);
                /* Eviction (by any process) after the hoard finished may have removed hoarded objects. */
                fprintf(f,
                        ",\"hoard\":{\"state\":\"%s\",\"complete\":%s,\"chunks_done\":%llu,\"chunks_total\":%llu,"
                        "\"chunks_failed\":%llu,\"chunks_unstored\":%llu,\"cache_full\":%s,\"bytes_done\":%llu,"
                        "\"bytes_total\":%llu,\"bytes_fetched\":%llu,\"seconds\":%.3f,\"priority\":\"%s\"}",
                        hoard_state_name(p.state),
                        p.state == HOARD_DONE && p.chunks_failed == 0 && !p.cache_full &&
                                cs.evictions_total == p.evictions_at_done ? "true" : "false",
                        U(p.chunks_done), U(p.chunks_total), U(p.chunks_failed), U(p.chunks_unstored),
                        p.cache_full ? "true" : "false", U(p.bytes_done), U(p.bytes_total), U(p.bytes_fetched),
                        p.seconds, p.priority == FETCH_IDLE ? "idle" : "hoard");
        }
        if (d->writeback) {
                WritebackStatus w;

                writeback_status(d->writeback, &w);
                fprintf(f,
                        ",\"writeback\":{\"trickle\":%s,\"rate\":%llu,\"uploading\":%s,\"uploaded_chunks\":%llu,"
                        "\"uploaded_bytes\":%llu,\"failed\":%llu}",
                        w.trickle ? "true" : "false", U(w.rate), w.uploading ? "true" : "false",
                        U(w.uploaded_chunks), U(w.uploaded_bytes), U(w.failed));
        }
        fprintf(f, ",\"trace\":{\"active\":%s}}\n", trace_active(d->trace) ? "true" : "false");
        if (fclose(f) != 0) {
                free(text);
                return -ENOMEM;
        }
        *ret_text = text;
        *ret_len = len;
        return 0;
}

/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * vulpes-fetch: fetches chunk objects by tag from the ISR server into the shared chunk cache, with no key.
 *
 * This is the transfer engine of keyless hoarding (`isr hoard --no-key`, `isr schedule run`): the server
 * lists a version's tags (GET /v1/parcels/{p}/versions/{n}/chunks), isr hands this program the tags, and it
 * keeps a window of requests in flight on fetch.c's HTTP/2 connection (the same code, pinning, retries and
 * tag verification as vulpes), then stores the objects with cache.c in batches that are made durable
 * before their names appear.  Objects already in the cache are skipped.  Progress is JSON lines on
 * stdout; diagnostics go to stderr.
 *
 * Exit status: 0 every tag is in the cache; 1 some object could not be had (the server does not have it,
 * or every copy failed verification) or could not be stored; 2 usage; 75 the server was unreachable for
 * longer than --patience; 128+N stopped by signal N (what was fetched so far is kept).
 *
 * A full cache: objects this run stored or found are never evicted to make room for the rest (they are
 * touched, and the batches evict only what was used before the run started).  When the cache has no room
 * left for the next object, no more requests go out; the last line says "cache_full": true and "stored"
 * counts exactly the objects that were added, and the exit status is 1.
 *
 * Threading: the main thread reads the tags, queues requests, commits batches and reports; fetch.c's
 * thread runs the transfers and the completion callback, which writes each object's temporary file.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "cache.h"
#include "fetch.h"
#include "hex.h"
#include "log.h"
#include "stats.h"

enum {
        EXIT_USAGE = 2,
        EXIT_UNREACHABLE = 75,          /* sysexits' EX_TEMPFAIL: try again later */
        BATCH_OBJECTS = 256,            /* objects made durable together */
        BATCH_SECONDS = 1,              /* and at least this often */
        TICK_MS = 100,
};

static const char usage_text[] =
        "usage: vulpes-fetch --cache=DIR --server=URL --token-file=FILE [options] [< TAGS]\n"
        "       vulpes-fetch --cache=DIR --usage\n"
        "       vulpes-fetch --cache=DIR --check|--drop [< TAGS]\n"
        "\n"
        "Fetches chunk objects (64 hex digits a line, from --tags=FILE or standard input) that DIR lacks from\n"
        "the ISR server, verifies each against its tag and stores it in the chunk cache DIR.  Needs no key.\n"
        "Prints JSON lines: start, progress, then done, stopped or error.  With --usage, prints what the cache\n"
        "holds and the room on its file system (one JSON line) and fetches nothing; with --unpin=STATE, drops\n"
        "every pin of that parcel's state directory (after a checkin: the server has its objects).  With\n"
        "--check, verifies the cached objects of the tags and quarantines bad ones (exit 1 if any); with --drop,\n"
        "removes them from the cache unless pinned (not yet uploaded).  Each prints one JSON line.\n"
        "\n"
        "  --cache=DIR             shared chunk cache (created if missing)\n"
        "  --server=URL            ISR server base URL (https://host:port)\n"
        "  --token-file=FILE       bearer token for the server\n"
        "  --ca=FILE               CA bundle or self-signed certificate to verify the server with\n"
        "  --pin=PIN               curl public-key pin, sha256//BASE64 (alone: pin without CA check)\n"
        "  --tags=FILE             read the tags from FILE instead of standard input\n"
        "  --max-transfers=N       concurrent transfers (default 16)\n"
        "  --window=N              requests queued or in flight (default 64)\n"
        "  --cache-limit=SIZE      evict least recently used cache objects above SIZE (512, 20G; default none)\n"
        "  --patience=SECONDS      give up (exit 75) when the server has been unreachable this long\n"
        "                          (default 120; 0: never)\n"
        "  --progress-interval=MS  time between progress lines (default 500)\n"
        "  --usage                 say what the cache holds, from its index, and exit\n"
        "  --owner=STATE           with --usage: also the bytes pinned by that parcel's state directory\n"
        "  --unpin=STATE           drop every pin of that parcel's state directory, and exit\n"
        "  --check                 verify the cached objects of the tags (quarantine bad ones), and exit\n"
        "  --drop                  remove the tags' objects from the cache unless pinned, and exit\n"
        "  --log-level=LEVEL       error, warning, info (default), debug\n"
        "  --version               print the version and exit\n";

typedef struct Options {
        const char *cache_dir, *server_url, *token_file, *ca_file, *pinned_key, *tags_path, *cache_limit;
        const char *owner, *unpin;
        unsigned max_transfers, window, patience_s, progress_ms;
        bool usage;
        bool check;
        bool drop;
} Options;

typedef struct Run Run;

/* One tag to fetch; the completion callback's userdata. */
typedef struct Item {
        Run *run;
        uint8_t tag[CACHE_TAG_LEN];
} Item;

struct Run {
        Cache *cache;
        Fetcher *fetcher;
        pthread_mutex_t lock;
        pthread_cond_t cond;            /* a request completed */
        CacheBatch *batch;              /* fetched objects not yet committed */
        size_t batch_n;
        unsigned outstanding;
        uint64_t fetched, bytes, failed, stored;
        int store_error;                /* the first failure to store an object, 0 if none */
        bool cache_full;                /* no room left for the next object: no more requests */
        int64_t keep_since;             /* the run's start: its batches evict only what was used before */

        size_t tags, cached, wanted;
        struct timespec started, last_report, last_commit;
        unsigned progress_ms;
};

static volatile sig_atomic_t stop_signal;

static void on_signal(int signo) {
        stop_signal = signo;
}

static double seconds_since(const struct timespec *t) {
        struct timespec now;

        clock_gettime(CLOCK_MONOTONIC, &now);
        return (double) (now.tv_sec - t->tv_sec) + (double) (now.tv_nsec - t->tv_nsec) / 1e9;
}

/* --- reporting -------------------------------------------------------------------------------------- */

static void emit(json_t *event) {
        if (!event)
                return;
        json_dumpf(event, stdout, JSON_COMPACT);
        fputc('\n', stdout);
        fflush(stdout);
        json_decref(event);
}

/* A progress-like event with the counters; the caller holds no lock. */
static void report(Run *run, const char *event, json_t *extra) {
        json_t *line;

        pthread_mutex_lock(&run->lock);
        line = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:b, s:f}", "event", event,
                         "wanted", (json_int_t) run->wanted, "fetched", (json_int_t) run->fetched,
                         "stored", (json_int_t) run->stored, "failed", (json_int_t) run->failed,
                         "bytes", (json_int_t) run->bytes, "outstanding", (json_int_t) run->outstanding,
                         "cache_full", run->cache_full, "seconds", seconds_since(&run->started));
        pthread_mutex_unlock(&run->lock);
        if (line && extra)
                json_object_update(line, extra);
        json_decref(extra);
        emit(line);
        clock_gettime(CLOCK_MONOTONIC, &run->last_report);
}

/* --- storing ---------------------------------------------------------------------------------------- */

static void on_fetched(int result, const uint8_t *object, size_t len, void *userdata) {
        Item *item = userdata;
        Run *run = item->run;
        char hex[CACHE_TAG_LEN * 2 + 1];
        int r = result;

        pthread_mutex_lock(&run->lock);
        if (r == 0) {
                /* fetch.c hands over only objects whose SHA-256 is the tag. */
                r = cache_batch_add(run->batch, item->tag, object, len);
                if (r < 0 && !run->store_error)
                        run->store_error = r;
                if (r == -ENOSPC || r == -EDQUOT)
                        run->cache_full = true;
        }
        if (r == 0) {
                run->batch_n++;
                run->fetched++;
                run->bytes += len;
        } else if (result != -ECANCELED) {
                run->failed++;
                hex_encode(item->tag, CACHE_TAG_LEN, hex);
                if (result < 0)
                        log_warning("failed to fetch chunk %s: %s", hex, result == -ENOENT ?
                                    "the server does not have it" : "every copy failed verification");
        }
        run->outstanding--;
        pthread_cond_broadcast(&run->cond);
        pthread_mutex_unlock(&run->lock);
}

/* Makes every object fetched so far durable and visible under its name. */
static int batch_commit(Run *run) {
        CacheBatch *full, *fresh = NULL;
        size_t n;
        int r;

        r = cache_batch_new(run->cache, false, &fresh);
        if (r < 0)
                return r;
        cache_batch_keep_since(fresh, run->keep_since);
        pthread_mutex_lock(&run->lock);
        full = run->batch;
        n = run->batch_n;
        run->batch = fresh;
        run->batch_n = 0;
        pthread_mutex_unlock(&run->lock);
        r = cache_batch_commit(full);
        cache_batch_free(full);
        clock_gettime(CLOCK_MONOTONIC, &run->last_commit);
        pthread_mutex_lock(&run->lock);
        if (r < 0) {
                log_error("failed to store %zu chunk objects in the cache: %s", n, strerror(-r));
                run->failed += n;
                if (!run->store_error)
                        run->store_error = r;
                if (r == -ENOSPC || r == -EDQUOT)
                        run->cache_full = true;
        } else {
                run->stored += n;
        }
        pthread_mutex_unlock(&run->lock);
        return r;
}

/*
 * Waits until at most `most` requests are outstanding, committing batches and reporting meanwhile.
 * Returns 0, -EINTR when a signal asks to stop, or -ETIMEDOUT when the server has been unreachable for
 * longer than patience_s (0: never).
 */
static int wait_outstanding(Run *run, unsigned most, unsigned patience_s) {
        for (;;) {
                struct timespec deadline;
                FetchStatus status;
                bool room, commit_now;

                if (stop_signal)
                        return -EINTR;
                pthread_mutex_lock(&run->lock);
                room = run->outstanding <= most;
                commit_now = run->batch_n >= BATCH_OBJECTS ||
                             (run->batch_n > 0 && seconds_since(&run->last_commit) >= BATCH_SECONDS);
                if (!room && !commit_now) {
                        clock_gettime(CLOCK_MONOTONIC, &deadline);
                        deadline.tv_nsec += TICK_MS * 1000000L;
                        if (deadline.tv_nsec >= 1000000000L) {
                                deadline.tv_sec++;
                                deadline.tv_nsec -= 1000000000L;
                        }
                        pthread_cond_timedwait(&run->cond, &run->lock, &deadline);
                        room = run->outstanding <= most;
                }
                pthread_mutex_unlock(&run->lock);
                if (commit_now)
                        batch_commit(run);
                if (seconds_since(&run->last_report) * 1000 >= run->progress_ms)
                        report(run, "progress", NULL);
                if (room)
                        return 0;
                fetch_status(run->fetcher, &status);
                if (patience_s && status.waiting && status.waiting_seconds > patience_s) {
                        log_error("failed to reach the server for %u s: %s", patience_s,
                                  status.last_error[0] ? status.last_error : "no answer");
                        return -ETIMEDOUT;
                }
        }
}

/* --- input and options ------------------------------------------------------------------------------ */

/* Reads one tag a line (blank lines skipped); -EINVAL names the first bad line. */
static int tags_read(const char *path, Run *run, Item **ret_items, size_t *ret_n) {
        FILE *f = stdin;
        Item *items = NULL;
        size_t n = 0, capacity = 0, line_no = 0, line_cap = 0;
        char *line = NULL;
        ssize_t len;
        int r = 0;

        if (path && strcmp(path, "-") != 0) {
                f = fopen(path, "re");
                if (!f) {
                        r = -errno;
                        log_error("failed to open %s: %s", path, strerror(-r));
                        return r;
                }
        }
        while ((len = getline(&line, &line_cap, f)) >= 0) {
                line_no++;
                while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' '))
                        line[--len] = 0;
                if (len == 0)
                        continue;
                if (n == capacity) {
                        size_t more = capacity ? capacity * 2 : 1024;
                        Item *p = realloc(items, more * sizeof(*p));

                        if (!p) {
                                r = -ENOMEM;
                                break;
                        }
                        items = p;
                        capacity = more;
                }
                if (len != CACHE_TAG_LEN * 2 || hex_decode_exact(line, items[n].tag, CACHE_TAG_LEN) < 0) {
                        log_error("failed to read the tags: line %zu is not 64 hex digits", line_no);
                        r = -EINVAL;
                        break;
                }
                items[n++].run = run;
        }
        if (r == 0 && ferror(f))
                r = -EIO;
        free(line);
        if (f != stdin)
                fclose(f);
        if (r < 0) {
                free(items);
                return r;
        }
        *ret_items = items;
        *ret_n = n;
        return 0;
}

static bool parse_unsigned(const char *text, unsigned *ret) {
        char *end;
        unsigned long v;

        errno = 0;
        v = strtoul(text, &end, 10);
        if (errno || end == text || *end || v > 1000000)
                return false;
        *ret = (unsigned) v;
        return true;
}

/* Parses and validates; returns 0, 1 for --help, 2 for --version, or -EINVAL after one line saying what to change. */
static int options_parse(int argc, char **argv, Options *o) {
        static const struct option options[] = {
                { "cache", required_argument, NULL, 'c' },
                { "server", required_argument, NULL, 's' },
                { "token-file", required_argument, NULL, 't' },
                { "ca", required_argument, NULL, 'a' },
                { "pin", required_argument, NULL, 'p' },
                { "tags", required_argument, NULL, 'g' },
                { "max-transfers", required_argument, NULL, 'm' },
                { "window", required_argument, NULL, 'w' },
                { "cache-limit", required_argument, NULL, 'l' },
                { "patience", required_argument, NULL, 'P' },
                { "progress-interval", required_argument, NULL, 'i' },
                { "log-level", required_argument, NULL, 'L' },
                { "usage", no_argument, NULL, 'u' },
                { "owner", required_argument, NULL, 'o' },
                { "unpin", required_argument, NULL, 'U' },
                { "check", no_argument, NULL, 'C' },
                { "drop", no_argument, NULL, 'D' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },
                {},
        };
        int c, index = 0, level;

        opterr = 0;
        while ((c = getopt_long(argc, argv, "h", options, &index)) >= 0) {
                switch (c) {
                case 'c': o->cache_dir = optarg; break;
                case 's': o->server_url = optarg; break;
                case 't': o->token_file = optarg; break;
                case 'a': o->ca_file = optarg; break;
                case 'p': o->pinned_key = optarg; break;
                case 'g': o->tags_path = optarg; break;
                case 'l': o->cache_limit = optarg; break;
                case 'h': return 1;
                case 'V': return 2;
                case 'u': o->usage = true; break;
                case 'o': o->owner = optarg; break;
                case 'U': o->unpin = optarg; break;
                case 'C': o->check = true; break;
                case 'D': o->drop = true; break;
                case 'm':
                case 'w':
                case 'P':
                case 'i': {
                        unsigned *target = c == 'm' ? &o->max_transfers : c == 'w' ? &o->window :
                                           c == 'P' ? &o->patience_s : &o->progress_ms;

                        if (!parse_unsigned(optarg, target)) {
                                log_error("--%s takes a whole number, not %s", options[index].name, optarg);
                                return -EINVAL;
                        }
                        break;
                }
                case 'L':
                        level = log_level_parse(optarg);
                        if (level < 0) {
                                log_error("--log-level must be error, warning, info or debug, not %s", optarg);
                                return -EINVAL;
                        }
                        log_set_max_level(level);
                        break;
                default:
                        log_error("unknown option or missing value: %s (see --help)", argv[optind - 1]);
                        return -EINVAL;
                }
        }
        if (optind < argc) {
                log_error("unexpected argument %s: the tags come from --tags=FILE or standard input", argv[optind]);
                return -EINVAL;
        }
        if (o->check && o->drop) {
                log_error("--check and --drop exclude each other");
                return -EINVAL;
        }
        if (o->usage || o->unpin || o->check || o->drop) {
                if (!o->cache_dir) {
                        log_error("--%s needs --cache=DIR", o->usage ? "usage" : o->unpin ? "unpin" :
                                  o->check ? "check" : "drop");
                        return -EINVAL;
                }
                return 0;
        }
        if (!o->cache_dir || !o->server_url || !o->token_file) {
                log_error("--cache=DIR, --server=URL and --token-file=FILE are required");
                return -EINVAL;
        }
        if (strncmp(o->server_url, "https://", 8) != 0 && strncmp(o->server_url, "http://", 7) != 0) {
                log_error("--server must be an https:// (or http://) URL, not %s", o->server_url);
                return -EINVAL;
        }
        if (o->cache_limit && cache_size_parse(o->cache_limit) < 0) {
                log_error("--cache-limit must be a size in MiB or with a suffix (512, 512M, 20G), not %s",
                          o->cache_limit);
                return -EINVAL;
        }
        if (!o->max_transfers || !o->window) {
                log_error("--max-transfers and --window must be at least 1");
                return -EINVAL;
        }
        return 0;
}

/* --- main ------------------------------------------------------------------------------------------- */

/* A parcel's pin owner: the real path of its state directory (what vulpes uses, daemon.c). */
static void owner_name(const char *state_dir, char owner[PATH_MAX]) {
        if (!realpath(state_dir, owner))
                snprintf(owner, PATH_MAX, "%s", state_dir);
}

/* cache_open(), saying which cache could not be opened. */
static int open_cache(const char *dir, Cache **ret) {
        int r = cache_open(dir, ret);

        if (r < 0)
                log_error("failed to open the cache %s: %s", dir, strerror(-r));
        return r;
}

/*
 * --usage: the cache's own account of itself, so that no other program walks its layout; with --owner, the
 * bytes that parcel has pinned (not yet uploaded), and with --cache-limit the room under that limit.
 */
static int print_usage_of(const Options *o) {
        char owner[PATH_MAX];
        Cache *cache = NULL;
        CacheStatus st;
        int r;

        r = open_cache(o->cache_dir, &cache);
        if (r < 0)
                return EXIT_FAILURE;
        if (o->owner) {
                owner_name(o->owner, owner);
                r = cache_set_owner(cache, owner);
        }
        if (r >= 0 && o->cache_limit)
                r = cache_set_limit(cache, (uint64_t) cache_size_parse(o->cache_limit));
        if (r >= 0)
                r = cache_status(cache, &st);
        cache = cache_free(cache);
        if (r < 0) {
                log_error("failed to read the cache index of %s: %s", o->cache_dir, strerror(-r));
                return EXIT_FAILURE;
        }
        emit(json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "event", "usage",
                       "objects", (json_int_t) st.objects, "bytes", (json_int_t) st.bytes,
                       "pinned", (json_int_t) st.pinned, "pinned_bytes", (json_int_t) st.pinned_bytes,
                       "own_pinned_bytes", (json_int_t) st.own_pinned_bytes,
                       "evictions_total", (json_int_t) st.evictions_total, "limit", (json_int_t) st.limit,
                       "fs_free", (json_int_t) st.fs_free, "fs_size", (json_int_t) st.fs_size,
                       "room", (json_int_t) (st.room > INT64_MAX ? INT64_MAX : st.room)));
        return EXIT_SUCCESS;
}

/* --unpin: after a checkin the server has every object of that parcel; the cache may evict them. */
static int unpin_owner(const char *cache_dir, const char *state_dir) {
        char owner[PATH_MAX], other[PATH_MAX + 16];
        Cache *cache = NULL;
        int r;

        r = open_cache(cache_dir, &cache);
        if (r < 0)
                return EXIT_FAILURE;
        owner_name(state_dir, owner);
        snprintf(other, sizeof(other), "%s#disconnected", owner);
        r = cache_pins_replace_owner(cache, owner, NULL, 0);
        if (r >= 0)
                r = cache_pins_replace_owner(cache, other, NULL, 0);
        cache = cache_free(cache);
        return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

/*
 * --check and --drop: the tags' objects in the cache, verified (a bad one is quarantined by the read, so
 * that it is fetched again) or removed unless pinned.  One JSON line; exit 1 if an object was bad or
 * could not be read or removed.
 */
static int check_or_drop(const Options *o) {
        Item *items = NULL;
        Cache *cache = NULL;
        size_t n = 0, present = 0, absent = 0, errors = 0, pinned = 0;
        uint64_t bytes = 0;
        json_t *bad = json_array();
        int r, status = EXIT_FAILURE;

        if (!bad)
                return EXIT_FAILURE;
        r = tags_read(o->tags_path, NULL, &items, &n);
        if (r < 0)
                goto out;
        r = open_cache(o->cache_dir, &cache);
        if (r < 0)
                goto out_items;
        if (o->drop) {
                uint8_t (*tags)[CACHE_TAG_LEN] = calloc(n ? n : 1, CACHE_TAG_LEN);

                if (!tags)
                        goto out_cache;
                for (size_t i = 0; i < n; i++)
                        memcpy(tags[i], items[i].tag, CACHE_TAG_LEN);
                r = cache_drop(cache, (const uint8_t (*)[CACHE_TAG_LEN]) tags, n, &bytes, &pinned);
                free(tags);
                if (r < 0) {
                        log_error("failed to drop objects from the cache %s: %s", o->cache_dir, strerror(-r));
                        goto out_cache;
                }
                emit(json_pack("{s:s, s:I, s:I, s:I, s:I}", "event", "drop", "tags", (json_int_t) n,
                               "dropped", (json_int_t) r, "bytes", (json_int_t) bytes, "pinned", (json_int_t) pinned));
                status = EXIT_SUCCESS;
                goto out_cache;
        }
        for (size_t i = 0; i < n; i++) {
                char hex[CACHE_TAG_LEN * 2 + 1];
                uint8_t *object = NULL;
                size_t len = 0;

                r = cache_get(cache, items[i].tag, &object, &len);
                free(object);
                if (r == 0) {
                        present++;
                        bytes += len;
                } else if (r == -ENOENT) {
                        absent++;
                } else if (r == -EBADMSG) {
                        hex_encode(items[i].tag, CACHE_TAG_LEN, hex);
                        json_array_append_new(bad, json_string(hex));
                } else {
                        hex_encode(items[i].tag, CACHE_TAG_LEN, hex);
                        log_error("failed to read cache object %s: %s", hex, strerror(-r));
                        errors++;
                }
        }
        emit(json_pack("{s:s, s:I, s:I, s:I, s:I, s:O, s:I}", "event", "check", "tags", (json_int_t) n,
                       "present", (json_int_t) present, "absent", (json_int_t) absent, "bytes", (json_int_t) bytes,
                       "bad", bad, "errors", (json_int_t) errors));
        status = json_array_size(bad) || errors ? EXIT_FAILURE : EXIT_SUCCESS;
out_cache:
        cache_free(cache);
out_items:
        free(items);
out:
        json_decref(bad);
        return status;
}

int main(int argc, char **argv) {
        Options o = { .max_transfers = 16, .window = 64, .patience_s = 120, .progress_ms = 500 };
        static Stats stats;
        Run run = { .lock = PTHREAD_MUTEX_INITIALIZER };
        pthread_condattr_t cond_attr;
        struct sigaction action = { .sa_handler = on_signal };
        FetchConfig config;
        Item *items = NULL;
        size_t n = 0;
        int r, status = EXIT_FAILURE;

        log_set_ident("vulpes-fetch");
        r = options_parse(argc, argv, &o);
        if (r != 0) {
                if (r == 1)
                        fputs(usage_text, stdout);
                else if (r == 2)
                        printf("vulpes-fetch %s\n", ISR_VERSION);
                return r > 0 ? EXIT_SUCCESS : EXIT_USAGE;
        }
        if (o.usage)
                return print_usage_of(&o);
        if (o.unpin)
                return unpin_owner(o.cache_dir, o.unpin);
        if (o.check || o.drop)
                return check_or_drop(&o);
        pthread_condattr_init(&cond_attr);
        pthread_condattr_setclock(&cond_attr, CLOCK_MONOTONIC);
        pthread_cond_init(&run.cond, &cond_attr);
        pthread_condattr_destroy(&cond_attr);
        run.progress_ms = o.progress_ms;
        sigemptyset(&action.sa_mask);
        sigaction(SIGTERM, &action, NULL);
        sigaction(SIGINT, &action, NULL);
        sigaction(SIGHUP, &action, NULL);

        r = tags_read(o.tags_path, &run, &items, &n);
        if (r < 0)
                goto out;
        r = cache_open(o.cache_dir, &run.cache);
        if (r < 0)
                goto out_items;
        if (o.cache_limit) {
                r = cache_set_limit(run.cache, (uint64_t) cache_size_parse(o.cache_limit));
                if (r < 0) {
                        log_error("failed to set the cache limit: %s", strerror(-r));
                        goto out_cache;
                }
        }
        run.keep_since = cache_now_us();
        r = cache_batch_new(run.cache, false, &run.batch);
        if (r < 0)
                goto out_cache;
        cache_batch_keep_since(run.batch, run.keep_since);
        /* Skip what is cached (and keep it: used now); the rest, in the given order (a working set comes
         * first touch first). */
        run.tags = n;
        for (size_t i = 0; i < n; i++) {
                if (cache_has(run.cache, items[i].tag)) {
                        cache_touch(run.cache, items[i].tag);
                        run.cached++;
                } else {
                        items[run.wanted++] = items[i];
                }
        }
        emit(json_pack("{s:s, s:I, s:I, s:I}", "event", "start", "tags", (json_int_t) run.tags,
                       "cached", (json_int_t) run.cached, "wanted", (json_int_t) run.wanted));

        config = (FetchConfig) { .server_url = o.server_url, .token_file = o.token_file, .ca_file = o.ca_file,
                                 .pinned_key = o.pinned_key, .max_transfers = o.max_transfers,
                                 .hoard_transfers = o.max_transfers };
        r = fetch_new(&config, &stats, &run.fetcher);
        if (r < 0) {
                log_error("failed to start fetching: %s", strerror(-r));
                goto out_batch;
        }
        clock_gettime(CLOCK_MONOTONIC, &run.started);
        run.last_report = run.last_commit = run.started;

        for (size_t i = 0; i < run.wanted && r >= 0; i++) {
                bool full;

                r = wait_outstanding(&run, o.window - 1, o.patience_s);
                if (r < 0)
                        break;
                pthread_mutex_lock(&run.lock);
                full = run.cache_full;
                pthread_mutex_unlock(&run.lock);
                if (full) {
                        log_error("failed to hoard every chunk: the cache %s has no room left", o.cache_dir);
                        break;
                }
                pthread_mutex_lock(&run.lock);
                run.outstanding++;
                pthread_mutex_unlock(&run.lock);
                r = fetch_get(run.fetcher, items[i].tag, FETCH_HOARD, on_fetched, &items[i]);
                if (r < 0) {
                        log_error("failed to queue a chunk request: %s", strerror(-r));
                        pthread_mutex_lock(&run.lock);
                        run.outstanding--;
                        pthread_mutex_unlock(&run.lock);
                }
        }
        if (r >= 0)
                r = wait_outstanding(&run, 0, o.patience_s);
        /* Requests still queued complete with -ECANCELED; every callback has run when this returns. */
        run.fetcher = fetch_free(run.fetcher);
        batch_commit(&run);

        if (r == -EINTR) {
                report(&run, "stopped", json_pack("{s:i}", "signal", (int) stop_signal));
                status = 128 + stop_signal;
        } else if (r == -ETIMEDOUT) {
                report(&run, "error", json_pack("{s:s}", "error", "the server was unreachable for too long"));
                status = EXIT_UNREACHABLE;
        } else {
                report(&run, "done", NULL);
                status = r < 0 || run.failed || run.store_error ? EXIT_FAILURE : EXIT_SUCCESS;
        }

out_batch:
        run.batch = cache_batch_free(run.batch);
out_cache:
        run.cache = cache_free(run.cache);
out_items:
        free(items);
out:
        pthread_cond_destroy(&run.cond);
        return status;
}

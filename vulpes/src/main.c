/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * vulpes: serves a parcel's disk and memory images as files on a FUSE mount, fetching chunks from the
 * ISR server on demand.  main() parses options (fuse_opt), reads the keys from an inherited file
 * descriptor, builds the daemon, mounts, serves, and unwinds in reverse order.
 */
#define FUSE_USE_VERSION 314
#define _GNU_SOURCE
#include <errno.h>
#include <fuse.h>
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cache.h"
#include "control.h"
#include "crypto.h"
#include "daemon.h"
#include "mount.h"
#include "log.h"
#include "warm.h"

typedef struct Options {
        char *state_dir;
        char *cache_dir;
        char *server_url;
        char *token_file;
        char *ca_file;
        char *pinned_key;
        int key_fd;
        char *control_path;
        char *trace_path;
        int offline;
        unsigned ram_cache_mib;
        unsigned flush_interval_ms;
        unsigned max_transfers;
        unsigned hoard_window;
        unsigned max_threads;
        unsigned kernel_readahead_kib;
        unsigned warm_after;
        int hoard;
        char *log_level;
        char *cache_limit;
        int foreground;
        int show_help;
        int show_version;
        char *mountpoint;
        char *memory_mountpoint;
        char **lookaside;
        size_t n_lookaside;
} Options;

enum {
        KEY_LOOKASIDE,
        KEY_FOREGROUND,
        KEY_HELP,
        KEY_VERSION,
};

#define OPTION(t, p) { t, offsetof(Options, p), 1 }
static const struct fuse_opt option_spec[] = {
        OPTION("--state=%s", state_dir),
        OPTION("--cache=%s", cache_dir),
        OPTION("--server=%s", server_url),
        OPTION("--token-file=%s", token_file),
        OPTION("--ca=%s", ca_file),
        OPTION("--pin=%s", pinned_key),
        OPTION("--key-fd=%d", key_fd),
        OPTION("--control=%s", control_path),
        OPTION("--trace=%s", trace_path),
        OPTION("--offline", offline),
        OPTION("--ram-cache=%u", ram_cache_mib),
        OPTION("--flush-interval=%u", flush_interval_ms),
        OPTION("--max-transfers=%u", max_transfers),
        OPTION("--hoard-window=%u", hoard_window),
        OPTION("--max-threads=%u", max_threads),
        OPTION("--kernel-readahead=%u", kernel_readahead_kib),
        OPTION("--memory-mount=%s", memory_mountpoint),
        OPTION("--warm-after=%u", warm_after),
        OPTION("--hoard", hoard),
        OPTION("--log-level=%s", log_level),
        OPTION("--cache-limit=%s", cache_limit),
        FUSE_OPT_KEY("--lookaside=", KEY_LOOKASIDE),
        FUSE_OPT_KEY("-f", KEY_FOREGROUND),
        FUSE_OPT_KEY("-h", KEY_HELP),
        FUSE_OPT_KEY("--help", KEY_HELP),
        FUSE_OPT_KEY("-V", KEY_VERSION),
        FUSE_OPT_KEY("--version", KEY_VERSION),
        FUSE_OPT_END,
};

static void usage(const char *program) {
        printf("usage: %s MOUNTPOINT --state=DIR --cache=DIR --key-fd=N [options]\n"
               "\n"
               "Serves a parcel's images as MOUNTPOINT/disk and MOUNTPOINT/memory, with live statistics in\n"
               "MOUNTPOINT/stats.  Runs in the foreground; stop it with fusermount3 -u MOUNTPOINT.\n"
               "\n"
               "  --state=DIR            parcel state: keyring.disk, keyring.memory (sqlite, doc/parcel-format.md)\n"
               "  --cache=DIR            shared chunk cache (created if missing)\n"
               "  --key-fd=N             read 64 bytes (parcel key || convergence secret) from descriptor N\n"
               "  --server=URL           ISR server base URL (https://host:port); without it, cache only\n"
               "  --token-file=FILE      bearer token for the server\n"
               "  --ca=FILE              CA bundle or self-signed certificate to verify the server with\n"
               "  --pin=PIN              curl public-key pin, sha256//BASE64 (alone: pin without CA check)\n"
               "  --lookaside=DIR        look for chunks here before the server (repeatable)\n"
               "  --control=PATH         control socket (JSON lines)\n"
               "  --trace=FILE           trace every chunk access to FILE from the start\n"
               "  --offline              start offline: server requests wait until 'online'\n"
               "  --hoard                hoard everything (continues a remembered hoard in any case)\n"
               "  --ram-cache=MIB        plaintext RAM cache per image (default 128)\n"
               "  --cache-limit=SIZE     bound the cache to SIZE (MiB, or with a suffix K, M, G, T; default 0: only\n"
               "                         its file system); least recently used clean objects make room\n"
               "  --flush-interval=MS    background flush of dirty chunks (default 5000)\n"
               "  --max-transfers=N      concurrent server transfers (default 16)\n"
               "  --hoard-window=N       hoard requests in flight (default 64)\n"
               "  --max-threads=N        FUSE worker threads (default 64)\n"
               "  --kernel-readahead=KIB the kernel's readahead on the mount, which is also the read-around of\n"
               "                         a page fault on the mapped memory image (default 32; at most 128)\n"
               "  --memory-mount=DIR     also serve the files at DIR with the kernel's readahead off, for QEMU to\n"
               "                         map DIR/memory: each page fault is then one 4 KiB read, so the trace\n"
               "                         names the very pages a guest touched (ends with MOUNTPOINT)\n"
               "  --warm-after=N         once N reads of the memory image are traced (a resumed guest's first\n"
               "                         page faults), fill the memory mount's page cache with the chunks that\n"
               "                         are here, ahead of the guest (default 2048; 0: never)\n"
               "  --log-level=LEVEL      error, warning, info (default: $VULPES_LOG_LEVEL, else info), debug;\n"
               "                         debug logs every GET with its queueing and transfer times\n"
               "  -d, -o OPT             libfuse options\n"
               "  -V, --version          print the version and exit\n",
               program);
}

static int option_proc(void *data, const char *arg, int key, struct fuse_args *outargs) {
        Options *o = data;

        (void) outargs;
        switch (key) {
        case KEY_LOOKASIDE: {
                char **p = realloc(o->lookaside, (o->n_lookaside + 1) * sizeof(*p));

                if (!p)
                        return -1;
                o->lookaside = p;
                o->lookaside[o->n_lookaside] = strdup(arg + strlen("--lookaside="));
                if (!o->lookaside[o->n_lookaside])
                        return -1;
                o->n_lookaside++;
                return 0;
        }
        case KEY_FOREGROUND:
                o->foreground = 1;
                return 0;
        case KEY_HELP:
                o->show_help = 1;
                return 0;
        case KEY_VERSION:
                o->show_version = 1;
                return 0;
        case FUSE_OPT_KEY_NONOPT:
                if (!o->mountpoint) {
                        o->mountpoint = strdup(arg);
                        return o->mountpoint ? 0 : -1;
                }
                fprintf(stderr, "vulpes: unexpected argument %s\n", arg);
                return -1;
        default:
                return 1;          /* libfuse's own option */
        }
}

/* Validates right after parsing; every complaint is one line that says what to change. */
static int options_check(Options *o) {
        if (!o->mountpoint) {
                log_error("no mountpoint given (vulpes MOUNTPOINT --state=DIR ...)");
                return -EINVAL;
        }
        if (!o->state_dir || !o->cache_dir) {
                log_error("--state=DIR and --cache=DIR are required");
                return -EINVAL;
        }
        if (o->key_fd < 0) {
                log_error("--key-fd=N is required: the keys are never read from a file");
                return -EINVAL;
        }
        if (o->server_url && strncmp(o->server_url, "https://", 8) != 0 && strncmp(o->server_url, "http://", 7) != 0) {
                log_error("--server must be an https:// (or http://) URL, not %s", o->server_url);
                return -EINVAL;
        }
        if (o->server_url && !o->token_file) {
                log_error("--server needs --token-file");
                return -EINVAL;
        }
        if (o->hoard && !o->server_url) {
                log_error("--hoard needs --server");
                return -EINVAL;
        }
        if (o->cache_limit && cache_size_parse(o->cache_limit) < 0) {
                log_error("--cache-limit must be a size in MiB or with a suffix (512, 512M, 20G), not %s",
                          o->cache_limit);
                return -EINVAL;
        }
        /* VULPES_LOG_LEVEL: the level for every vulpes a program starts (bench/ turns on debug this way). */
        if (!o->log_level && getenv("VULPES_LOG_LEVEL") && *getenv("VULPES_LOG_LEVEL"))
                o->log_level = strdup(getenv("VULPES_LOG_LEVEL"));
        if (o->log_level) {
                int level = log_level_parse(o->log_level);

                if (level < 0) {
                        log_error("--log-level must be error, warning, info or debug, not %s", o->log_level);
                        return -EINVAL;
                }
                log_set_max_level(level);
        }
        return 0;
}

/* Reads exactly DAEMON_KEYS_LEN bytes from fd and closes it; the keys exist only in this process's memory. */
static int keys_read(int fd, uint8_t ret[DAEMON_KEYS_LEN]) {
        size_t got = 0;
        uint8_t extra;

        while (got < DAEMON_KEYS_LEN) {
                ssize_t n = read(fd, ret + got, DAEMON_KEYS_LEN - got);

                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0) {
                        log_error("failed to read the keys from descriptor %d: %s", fd,
                                  n < 0 ? strerror(errno) : "it ended before 64 bytes");
                        close(fd);
                        crypto_wipe(ret, DAEMON_KEYS_LEN);
                        return -EINVAL;
                }
                got += (size_t) n;
        }
        if (read(fd, &extra, 1) > 0) {
                log_error("failed to read the keys from descriptor %d: more than 64 bytes", fd);
                close(fd);
                crypto_wipe(ret, DAEMON_KEYS_LEN);
                return -EINVAL;
        }
        close(fd);
        return 0;
}

static void options_free(Options *o) {
        free(o->state_dir);
        free(o->cache_dir);
        free(o->server_url);
        free(o->token_file);
        free(o->ca_file);
        free(o->pinned_key);
        free(o->control_path);
        free(o->trace_path);
        free(o->log_level);
        free(o->cache_limit);
        free(o->mountpoint);
        free(o->memory_mountpoint);
        for (size_t i = 0; i < o->n_lookaside; i++)
                free(o->lookaside[i]);
        free(o->lookaside);
}

/* The memory mount's thread: it serves until mount_stop() (the main mount ended) or its own unmount. */
static void *run_memory_mount(void *mount) {
        int r = mount_run(mount);

        if (r < 0)
                log_error("the memory mount failed: %s", strerror(-r));
        return NULL;
}

/* Unmounts the memory mount and joins its thread; false if the thread is still busy after 10 s, and then its
 * Mount must not be freed (the process exits without it).  Its connection ends with the unmount unless a
 * process still maps the memory image (QEMU has exited by the time the main mount goes): never wait on that
 * for ever. */
static bool memory_mount_end(Mount *m, pthread_t thread) {
        struct timespec deadline;

        mount_stop(m);
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += 10;
        if (pthread_timedjoin_np(thread, NULL, &deadline) != 0) {
                log_warning("the memory mount is still busy; exiting without it");
                return false;
        }
        return true;
}

int main(int argc, char *argv[]) {
        struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
        Options o = { .key_fd = -1, .ram_cache_mib = 128, .flush_interval_ms = 5000, .max_transfers = 16,
                      .hoard_window = 64, .max_threads = 64, .kernel_readahead_kib = 32, .warm_after = 2048 };
        DaemonConfig config = { 0 };
        FuseOptions fuse_options = { 0 };
        FuseOptions memory_options = { 0 };
        Daemon *daemon = NULL;
        Control *control = NULL;
        Mount *mount = NULL, *memory_mount = NULL;
        Warmer *warmer = NULL;
        pthread_t memory_thread;
        bool memory_running = false;
        int r, status = EXIT_FAILURE;

        log_set_ident("vulpes");
        /* Chunk buffers are 128 KiB and more, glibc's default mmap threshold: every chunk would be a fresh
         * mmap() with page faults and zeroing, and a munmap().  Keep them on the heap for reuse. */
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 128 << 20);
        if (fuse_opt_parse(&args, &o, option_spec, option_proc) != 0)
                goto out_options;
        if (o.show_help) {
                usage(argv[0]);
                status = EXIT_SUCCESS;
                goto out_options;
        }
        if (o.show_version) {
                printf("vulpes %s (libfuse %d)\n", ISR_VERSION, fuse_version());
                status = EXIT_SUCCESS;
                goto out_options;
        }
        if (options_check(&o) < 0)
                goto out_options;
        r = keys_read(o.key_fd, config.keys);
        if (r < 0)
                goto out_options;

        config.state_dir = o.state_dir;
        config.cache_dir = o.cache_dir;
        config.server_url = o.server_url;
        config.token_file = o.token_file;
        config.ca_file = o.ca_file;
        config.pinned_key = o.pinned_key;
        config.lookaside = (const char *const *) o.lookaside;
        config.n_lookaside = o.n_lookaside;
        config.trace_path = o.trace_path;
        config.offline = o.offline;
        config.ram_cache_bytes = (uint64_t) o.ram_cache_mib << 20;
        config.cache_limit_bytes = o.cache_limit ? (uint64_t) cache_size_parse(o.cache_limit) : 0;
        config.flush_interval_ms = o.flush_interval_ms;
        config.max_transfers = o.max_transfers;
        config.hoard_window = o.hoard_window;
        r = daemon_new(&config, &daemon);
        crypto_wipe(config.keys, sizeof(config.keys));
        if (r < 0)
                goto out_options;

        fuse_options.mountpoint = o.mountpoint;
        fuse_options.max_threads = o.max_threads;
        fuse_options.kernel_readahead_kib = o.kernel_readahead_kib;
        fuse_options.signals = true;
        fuse_options.argc = args.argc;
        fuse_options.argv = args.argv;
        r = mount_new(daemon, &fuse_options, &mount);
        if (r < 0)
                goto out_daemon;
        if (o.memory_mountpoint && o.warm_after > 0) {
                char *path = NULL;

                /* Before the mounts' invalidators: it stops before the kernel drops the pages. */
                if (asprintf(&path, "%s/memory", o.memory_mountpoint) < 0) {
                        r = -ENOMEM;
                        goto out_mount;
                }
                r = warm_new(daemon_image(daemon, DAEMON_IMAGE_MEMORY), path, o.warm_after, &warmer);
                free(path);
                if (r < 0)
                        goto out_mount;
                r = daemon_add_invalidator(daemon, warm_invalidator, warmer);
                if (r < 0)
                        goto out_mount;
                daemon_set_mapped_tracer(daemon, warm_trace_mapped, warmer);
        }
        r = daemon_add_invalidator(daemon, mount_invalidate, mount);
        if (r < 0)
                goto out_mount;
        if (o.memory_mountpoint) {
                memory_options = fuse_options;
                memory_options.mountpoint = o.memory_mountpoint;
                memory_options.kernel_readahead_kib = 0;
                memory_options.signals = false;
                r = mount_new(daemon, &memory_options, &memory_mount);
                if (r < 0)
                        goto out_mount;
                mount_set_warmer(memory_mount, warmer);
                r = -pthread_create(&memory_thread, NULL, run_memory_mount, memory_mount);
                if (r < 0) {
                        log_error("cannot start the memory mount: %s", strerror(-r));
                        goto out_mount;
                }
                memory_running = true;
                r = daemon_add_invalidator(daemon, mount_invalidate, memory_mount);
                if (r < 0)
                        goto out_mount;
                if (warmer) {
                        r = warm_start(warmer);
                        if (r < 0) {
                                log_error("cannot start the warmer: %s", strerror(-r));
                                goto out_mount;
                        }
                }
        }
        if (o.control_path) {
                r = control_start(daemon, o.control_path, &control);
                if (r < 0)
                        goto out_mount;
        }
        if (o.hoard && daemon_hoard(daemon)) {
                HoardTarget all[_DAEMON_IMAGE_MAX] = { { .all = true }, { .all = true } };

                r = hoard_start(daemon_hoard(daemon), all, FETCH_HOARD);
        } else {
                r = daemon_start_background(daemon);
        }
        if (r < 0)
                log_error("failed to start hoarding: %s", strerror(-r));
        log_info("serving %s", o.mountpoint);

        r = mount_run(mount);
        status = r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
        warm_close(warmer);                     /* its descriptor would keep the memory mount busy */
        if (memory_running && !memory_mount_end(memory_mount, memory_thread))
                memory_mount = NULL;
        memory_running = false;

        daemon_halt(daemon);
        control = control_stop(control);
out_mount:
        warm_close(warmer);
        /* A later step failed while the memory mount's thread served: end it before its Mount goes. */
        if (memory_running && !memory_mount_end(memory_mount, memory_thread))
                memory_mount = NULL;
        memory_mount = mount_free(memory_mount);
        mount = mount_free(mount);
        /* The control thread has stopped (or never ran): nobody calls the warmer any more. */
        warmer = warm_free(warmer);
out_daemon:
        /* daemon_free() flushes: whatever reached us before the unmount is made durable. */
        daemon = daemon_free(daemon);
out_options:
        fuse_opt_free_args(&args);
        options_free(&o);
        return status;
}

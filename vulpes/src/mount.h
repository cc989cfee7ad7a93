/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>

#include "daemon.h"

typedef struct FuseOptions {
        unsigned max_threads;
        /* The kernel's readahead on the mount, also the read-around of a page fault in a mapped file (KiB;
         * the kernel keeps it at or below its default of 128). */
        unsigned kernel_readahead_kib;
        /* This mount ends on SIGINT, SIGTERM and SIGHUP (libfuse keeps one such session per process). */
        bool signals;
        const char *mountpoint;
        int argc;                      /* libfuse's own options (-o ..., -d), argv[0] first */
        char **argv;
} FuseOptions;

typedef struct Mount Mount;

/* Mounts the daemon's files (disk, memory, stats) at the mountpoint. */
int mount_new(Daemon *d, const FuseOptions *options, Mount **ret);

/* Serves requests until the file system is unmounted or a signal (SIGINT, SIGTERM, SIGHUP) arrives. */
int mount_run(Mount *m);

/* Makes mount_run() return, from another thread: unmounts, which ends the kernel's connection (lazily: a
 * file still open keeps it until closed). */
void mount_stop(Mount *m);
/* The warmer whose requests this mount serves with image_warm_read() (warm.h); set before it starts. */
typedef struct Warmer Warmer;
void mount_set_warmer(Mount *m, Warmer *w);
/* A DaemonInvalidator (daemon.h): drops the kernel's cached pages of image `id` on this mount. */
int mount_invalidate(void *mount, DaemonImage id);

/* Unmounts (if still mounted) and frees. */
Mount *mount_free(Mount *m);

/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Lookaside sources: directories that may hold chunk objects by tag (a USB stick with a copy of the
 * parcel store, a neighbour's vulpes cache over NFS) and are cheaper than the server.  They are never
 * trusted: every object is verified against its tag, and a bad one is skipped.
 *
 * Threading: lookaside_get() is safe from any thread; the list is fixed at creation.
 */
#define _GNU_SOURCE
#include "lookaside.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chunk.h"
#include "file.h"
#include "hex.h"
#include "log.h"

struct Lookaside {
        char **dirs;
        size_t n;
        Stats *stats;
};

int lookaside_new(const char *const *dirs, size_t n, Stats *stats, Lookaside **ret) {
        Lookaside *l = calloc(1, sizeof(*l));

        if (!l)
                return -ENOMEM;
        l->stats = stats;
        l->dirs = calloc(n ? n : 1, sizeof(char *));
        if (!l->dirs) {
                free(l);
                return -ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
                l->dirs[i] = strdup(dirs[i]);
                if (!l->dirs[i]) {
                        l->n = i;
                        lookaside_free(l);
                        return -ENOMEM;
                }
        }
        l->n = n;
        *ret = l;
        return 0;
}

Lookaside *lookaside_free(Lookaside *l) {
        if (!l)
                return NULL;
        for (size_t i = 0; i < l->n; i++)
                free(l->dirs[i]);
        free(l->dirs);
        free(l);
        return NULL;
}

/* Reads path if it exists; 0 and the object, -ENOENT, or another error (logged at debug level). */
static int try_path(const char *path, uint8_t **ret, size_t *ret_len) {
        if (access(path, F_OK) < 0)
                return -ENOENT;
        return file_read_all(path, CHUNK_SIZE_MAX + CHUNK_OVERHEAD, ret, ret_len);
}

int lookaside_get(Lookaside *l, const uint8_t tag[LOOKASIDE_TAG_LEN], uint8_t **ret_object, size_t *ret_len) {
        char hex[LOOKASIDE_TAG_LEN * 2 + 1], path[PATH_MAX];

        if (!l || l->n == 0)
                return -ENOENT;
        hex_encode(tag, LOOKASIDE_TAG_LEN, hex);
        for (size_t i = 0; i < l->n; i++) {
                for (int layout = 0; layout < 2; layout++) {
                        uint8_t *data = NULL;
                        size_t len = 0;

                        snprintf(path, sizeof(path), "%s/%s%.2s/%.2s/%s", l->dirs[i], layout == 0 ? "chunks/" : "",
                                 hex, hex + 2, hex);
                        if (try_path(path, &data, &len) < 0)
                                continue;
                        if (chunk_verify_tag(data, len, tag) < 0) {
                                stats_add(&l->stats->lookaside_bad, 1);
                                log_info("lookaside object %s does not match its tag: ignored", path);
                                free(data);
                                continue;
                        }
                        *ret_object = data;
                        *ret_len = len;
                        return 0;
                }
        }
        return -ENOENT;
}

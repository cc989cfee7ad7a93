/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "stats.h"

#define LOOKASIDE_TAG_LEN 32

typedef struct Lookaside Lookaside;

/* A list of read-only directories to look in before the server; n may be 0. */
int lookaside_new(const char *const *dirs, size_t n, Stats *stats, Lookaside **ret);
Lookaside *lookaside_free(Lookaside *l);

/*
 * Looks for an object named tag in every directory, as <dir>/chunks/ab/cd/<hex> (a parcel store or a
 * vulpes cache) or <dir>/ab/cd/<hex>, and returns the first one whose SHA-256 matches (malloc()ed).
 * -ENOENT if none does.  Bad copies are skipped, not touched: the directories belong to someone else.
 */
int lookaside_get(Lookaside *l, const uint8_t tag[LOOKASIDE_TAG_LEN], uint8_t **ret_object, size_t *ret_len);

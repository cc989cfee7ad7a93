/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fetch.h"
#include "image.h"
#include "seal.h"

/*
 * The resume pack's later parts, fetched by vulpes itself (isr hands it the first part, which must be here
 * before QEMU starts, and then the list of the others): at FETCH_PACK priority, on the connection the guest's
 * misses use, right behind them and paced in bytes (fetch.c).  Each part is opened with the parcel key and
 * checked against the manifest's length and SHA-256 before image_preload() takes it.
 *
 * A part that cannot be had (the server has none, or its bytes do not open or match) ends the loading with
 * one warning: the parts already here stay, and no read waits for the others.  Past `keep` bytes of
 * plaintext, the loading stops where the parts still to come would take longer than `seconds` at the pace
 * the last ones came (packload_should_stop()): a pack made at a fast site is longer than a slow link should
 * carry before the guest's own misses.
 *
 * Threading: packload_start() and packload_progress() from any thread; the parts complete on the fetch
 * thread.
 */

#define PACKLOAD_KEEP_ALL UINT64_MAX

typedef struct PackPart {
        char *path;                     /* on the server: "/v1/parcels/<uuid>/versions/<n>/resumepack.<k>" */
        uint32_t index;                 /* the part's number in the pack (image_preload()) */
        uint64_t size;                  /* its payload's length, from the manifest */
        uint8_t sha256[32];             /* its payload's SHA-256, from the manifest */
} PackPart;

typedef struct PackLoadProgress {
        bool started, ended;
        bool stopped;                   /* the rest would have taken too long */
        bool failed;                    /* a part could not be had */
        unsigned parts, loaded;
        uint64_t bytes;                 /* image bytes the loaded parts hold */
        double seconds;                 /* from the start to the end (or now) */
} PackLoadProgress;

typedef struct PackLoad PackLoad;

int packload_new(Fetcher *fetcher, const uint8_t parcel_key[SEAL_PARCEL_KEY_LEN], PackLoad **ret);
/* After fetch_free() of its fetcher, which completes what is still queued. */
PackLoad *packload_free(PackLoad *l);

/*
 * Fetches the n parts (the array and its paths become the loader's) into img, in their order; once per
 * loader (-EBUSY after that).  keep: PACKLOAD_KEEP_ALL to take every part.
 */
int packload_start(PackLoad *l, Image *img, PackPart *parts, size_t n, uint64_t keep, double seconds);

void packload_progress(PackLoad *l, PackLoadProgress *ret);

/*
 * Whether to stop with `rest` payload bytes still to come and `used` bytes of image loaded, at a pace of
 * `opened` bytes of payload in elapsed_us (packload.c takes them over the last 16 parts: since the start, the
 * pace counted the pacer's first round trips, whose window was still growing, and at 100 Mbit/s a resume
 * stopped after 70 of 248 parts): once used reaches keep, if the rest would take more than `seconds` at that
 * pace.
 */
bool packload_should_stop(uint64_t used, uint64_t keep, uint64_t rest, uint64_t opened, uint64_t elapsed_us,
                          double seconds);

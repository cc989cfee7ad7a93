/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stats.h"

#define FETCH_TAG_LEN 32

typedef enum FetchPriority {
        FETCH_DEMAND,       /* a guest read is waiting */
        FETCH_AHEAD,        /* the chunks just after a guest's sequential reads: before any other background */
        FETCH_SOON,         /* what a resumed guest will likely touch soon: its resume pack's chunks (once the pack
                             * is in), the chunks after its faults in its memory */
        FETCH_HOARD,        /* background prefetch: only when no demand request is ready to start */
        FETCH_IDLE,         /* background that waits until no guest has waited for a while (fetch.c) */
        _FETCH_PRIORITY_MAX,
} FetchPriority;

typedef struct FetchConfig {
        const char *server_url;        /* base URL, e.g. https://127.0.0.1:8443 */
        const char *token_file;        /* bearer token; re-read when the server answers 401 */
        const char *ca_file;           /* PEM CA bundle or self-signed certificate; NULL: system CAs */
        const char *pinned_key;        /* curl pin ("sha256//<base64>" or a key file); NULL: none */
        unsigned max_transfers;        /* concurrent fetches (HTTP/2 streams); uploads have their own cap */
        unsigned hoard_transfers;      /* at most this many of them for hoarding */
        unsigned backoff_max_ms;       /* cap of the exponential backoff after a transient failure */
        bool offline;
} FetchConfig;

typedef struct Fetcher Fetcher;

/*
 * Called exactly once per fetch_get()/fetch_put(), from the fetch thread; the object is valid only
 * during the call.  result: 0; -ENOENT the server does not have the chunk (HTTP 404/410); -EBADMSG every
 * attempt returned bytes that do not match the tag (or the server refused an upload's bytes); -EIO
 * another definitive refusal; -ECANCELED the fetcher is shutting down.  Transient trouble (connection
 * failures, timeouts, 5xx, 429) never reaches the callback: the request is retried forever.
 */
typedef void (*FetchDone)(int result, const uint8_t *object, size_t len, void *userdata);

typedef struct FetchStatus {
        bool offline;
        bool waiting;                  /* some request is backing off after a transient failure */
        unsigned queued[_FETCH_PRIORITY_MAX];
        unsigned active;
        unsigned uploads;              /* queued or active */
        uint64_t waiting_seconds;      /* how long the oldest waiting request has been retrying */
        unsigned active_hoard;         /* hoard transfers running */
        unsigned hoard_limit;          /* how many may run now (pace.c) */
        uint64_t rtt_min_us;           /* lowest time to first byte lately (0: not measured) */
        uint64_t rate;                 /* highest delivery rate of the last second, bytes/s */
        uint64_t rate_peak;            /* highest delivery rate ever, bytes/s */
        char last_error[200];
} FetchStatus;

int fetch_new(const FetchConfig *config, Stats *stats, Fetcher **ret);

/* Stops the fetch thread; pending requests complete with -ECANCELED. */
Fetcher *fetch_free(Fetcher *f);

/*
 * Queues a GET of the chunk object named tag.  Requests for a tag that is already queued or in flight
 * share its transfer (a demand request raises a queued hoard request's priority).  Every object is
 * verified against its tag before it is handed to a callback.
 */
int fetch_get(Fetcher *f, const uint8_t tag[FETCH_TAG_LEN], FetchPriority priority, FetchDone done, void *userdata);

/* fetch_get() and wait: the object is malloc()ed. */
int fetch_get_wait(Fetcher *f, const uint8_t tag[FETCH_TAG_LEN], FetchPriority priority, uint8_t **ret_object,
                   size_t *ret_len);

/*
 * Queues a PUT of a chunk object, sent at most max_rate bytes per second (0: unlimited).  The object is
 * copied.
 */
int fetch_put(Fetcher *f, const uint8_t tag[FETCH_TAG_LEN], const void *object, size_t len, uint64_t max_rate,
              FetchDone done, void *userdata);

/*
 * While on (calls nest), uploads ignore their max_rate: queued ones start unthrottled, and one already
 * running at a rate is restarted at full speed (a full upload must not wait behind a trickle's object).
 */
void fetch_set_full_speed(Fetcher *f, bool on);

/* Offline: nothing new starts (requests wait, they do not fail) until online again. */
void fetch_set_offline(Fetcher *f, bool offline);

void fetch_status(Fetcher *f, FetchStatus *ret);

/* The link's bandwidth-delay product as the pacer measured it: its peak rate times the lowest round trip,
 * bytes (0: not measured yet). */
uint64_t fetch_bdp_bytes(Fetcher *f);

/* The link carried `rate` bytes/s over a stream vulpes did not fetch itself (the resume pack): its peak rate
 * (status `rate_peak`) is at least that. */
void fetch_note_rate(Fetcher *f, uint64_t rate);

/* SPDX-License-Identifier: GPL-2.0-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

/*
 * How many background transfers (hoard GETs) may be in flight: enough to keep the link full, and no more
 * than about one bandwidth-delay product plus a small queueing allowance, so that a demand request (a
 * guest waiting) never queues behind more background bytes than that.
 *
 * The window is rate_max * (rtt_min + PACE_TARGET_US) bytes, where rate_max is the highest delivery rate
 * seen over the last second (all GET bytes, demand and hoard: they share the link) and rtt_min the lowest
 * time to first byte over the last ten minutes (LEDBAT's base delay: a long hoard keeps every sample
 * queued, and a shorter memory would take that queue for the path); divided by the mean object size, at least PACE_MIN_TRANSFERS.
 * When the link is not yet full, the rate grows with the window and the window with the rate (by
 * (rtt_min + target) / rtt_min a round trip); once it is full the queue stays near PACE_TARGET_US.  Queued
 * bytes the window lets through are bytes a demand request waits behind, so a slow link runs at the
 * minimum: a demand miss then waits about one round trip and two object transmission times.
 *
 * Pure arithmetic on times the caller passes in (µs, monotonic): no locking, no clock, no I/O.
 */

enum {
        PACE_MIN_TRANSFERS = 2,          /* keeps a slow link busy between two objects */
        PACE_TARGET_US = 25000,          /* queueing delay allowed beyond the round trip */
        PACE_RATE_SAMPLES = 64,
        PACE_DELIVERY_MARKS = 64,
        PACE_RTT_PERIODS = 10,          /* rtt_min: the lowest of one sample per minute */
        PACE_PEAK_WINDOW_US = 500000,
};

typedef struct PaceMark {
        uint64_t at_us;
        uint64_t delivered;             /* bytes delivered up to then */
} PaceMark;

typedef struct Pace {
        unsigned max_transfers;         /* never more than this */
        uint64_t delivered;             /* GET body bytes received, ever */
        PaceMark marks[PACE_DELIVERY_MARKS];   /* (time, delivered) at recent completions, a ring */
        unsigned n_marks, next_mark;
        PaceMark rates[PACE_RATE_SAMPLES];     /* (time, bytes/s) rate samples, a ring */
        unsigned n_rates, next_rate;
        uint64_t rtt_min_us[PACE_RTT_PERIODS];  /* lowest time to first byte per minute, a ring (0: none) */
        unsigned rtt_period;                    /* the current minute's slot */
        uint64_t rtt_period_start_us;
        double object_bytes;            /* mean object size (moving average) */
        PaceMark peak_window;           /* where the current peak window started (time, delivered then) */
        uint64_t rate_peak;             /* the highest rate over a whole window so far */
} Pace;

void pace_init(Pace *p, unsigned max_transfers);

/* Body bytes of any GET arrived. */
void pace_delivered(Pace *p, size_t bytes);

/* A GET finished: its time to first byte (0: unknown) and its object size. */
void pace_completed(Pace *p, uint64_t now_us, uint64_t ttfb_us, size_t object_bytes);

/* How many background transfers may run now. */
unsigned pace_background_limit(const Pace *p, uint64_t now_us);

/*
 * How many may run while a guest is missing (its misses come one after another, each a round trip): the
 * objects that fit in half a bandwidth-delay product, rate_max * rtt_min / 2, and never more than
 * pace_background_limit().  A miss then waits at most about half a round trip behind them.  On a link where
 * one object takes longer than that (10 Mbit/s and 20 ms: a 40 KB object is 34 ms, the half BDP 12 KB)
 * none: background only runs between a guest's bursts.  On a fast one (100 Mbit/s: 125 KB) the stream
 * the guest will need next keeps going while it misses.  Before anything is measured: one.
 */
unsigned pace_demand_limit(const Pace *p, uint64_t now_us);

/*
 * The same for what a guest reading sequentially reads next (readahead): the objects that fit in a whole
 * bandwidth-delay product, pace_rate_peak() * rtt_min: at 100 Mbit/s +20 ms (about 250 KB) about six of the test
 * workload's 40 KB objects, at 10 Mbit/s (about 33 KB) none.
 */
unsigned pace_ahead_limit(const Pace *p, uint64_t now_us);

/* The current estimates, for the status report (0 where nothing has been measured yet). */
uint64_t pace_rtt_min_us(const Pace *p);
uint64_t pace_rate(const Pace *p, uint64_t now_us);
/*
 * The highest delivery rate over back-to-back windows of PACE_PEAK_WINDOW_US or more between completions,
 * bytes/s (0: none yet): what this site's link can carry.  The rate samples above span a few round trips,
 * which a token bucket's burst can fill well above the link's rate (a 10 Mbit/s link whose bucket holds
 * 256 KB read 32 Mbit/s); over half a second that burst adds 0.5 MB/s at most, while a session at 100 Mbit/s
 * still fills some window (whole seconds read 4.4-8.1 MB/s of its 12).
 */
uint64_t pace_rate_peak(const Pace *p);

/* A rate the link carried measured elsewhere (isr's resume pack stream, bytes/s): the peak is at least that. */
void pace_note_peak(Pace *p, uint64_t rate);

/* How long one object of the mean size takes on the link at the current rate, µs (0: not measured). */
uint64_t pace_object_time_us(const Pace *p, uint64_t now_us);

/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Pacing background transfers (see pace.h for the rule).  The estimates follow BBR's shape: the delivery
 * rate is a maximum over a short period (a queue that drains cannot make the link look slower than it is),
 * the round-trip time a minimum over a long one (queueing only ever adds to it).  Unlike BBR nothing here
 * probes: background transfers take what the window allows and demand requests go first (fetch.c).
 */
#include "pace.h"

#include <string.h>

enum {
        RATE_PERIOD_US = 1000000,        /* rate_max: the highest sample of the last second */
        RTT_PERIOD_US = 60000000,        /* rtt_min: one slot per minute, PACE_RTT_PERIODS of them */
        RATE_INTERVAL_MIN_US = 20000,    /* a rate sample spans at least this, and two round trips */
};

void pace_init(Pace *p, unsigned max_transfers) {
        memset(p, 0, sizeof(*p));
        p->max_transfers = max_transfers ? max_transfers : 1;
}

void pace_delivered(Pace *p, size_t bytes) {
        p->delivered += bytes;
}

uint64_t pace_rtt_min_us(const Pace *p) {
        uint64_t best = 0;

        for (unsigned k = 0; k < PACE_RTT_PERIODS; k++)
                if (p->rtt_min_us[k] && (!best || p->rtt_min_us[k] < best))
                        best = p->rtt_min_us[k];
        return best;
}

/* The newest mark at least `interval` old, else the oldest one if it is a quarter of that old; NULL if none. */
static const PaceMark *mark_before(const Pace *p, uint64_t now_us, uint64_t interval) {
        const PaceMark *oldest = NULL;

        for (unsigned k = 1; k <= p->n_marks; k++) {
                const PaceMark *m = &p->marks[(p->next_mark + PACE_DELIVERY_MARKS - k) % PACE_DELIVERY_MARKS];

                if (now_us - m->at_us >= interval)
                        return m;
                oldest = m;
        }
        return oldest && now_us - oldest->at_us >= interval / 4 && now_us > oldest->at_us ? oldest : NULL;
}

void pace_completed(Pace *p, uint64_t now_us, uint64_t ttfb_us, size_t object_bytes) {
        uint64_t rtt, interval;
        const PaceMark *then;

        /* A new minute (or several): their slots start empty. */
        for (unsigned k = 0; k < PACE_RTT_PERIODS && now_us - p->rtt_period_start_us >= RTT_PERIOD_US; k++) {
                p->rtt_period = (p->rtt_period + 1) % PACE_RTT_PERIODS;
                p->rtt_min_us[p->rtt_period] = 0;
                p->rtt_period_start_us = k + 1 < PACE_RTT_PERIODS ? p->rtt_period_start_us + RTT_PERIOD_US : now_us;
        }
        if (now_us - p->rtt_period_start_us >= RTT_PERIOD_US)
                p->rtt_period_start_us = now_us;
        if (ttfb_us && (!p->rtt_min_us[p->rtt_period] || ttfb_us < p->rtt_min_us[p->rtt_period]))
                p->rtt_min_us[p->rtt_period] = ttfb_us;
        p->object_bytes = p->object_bytes > 0 ? p->object_bytes * 0.875 + (double) object_bytes * 0.125
                                              : (double) object_bytes;

        rtt = pace_rtt_min_us(p);
        interval = 2 * rtt > RATE_INTERVAL_MIN_US ? 2 * rtt : RATE_INTERVAL_MIN_US;
        then = mark_before(p, now_us, interval);
        if (then && p->delivered > then->delivered) {
                PaceMark *sample = &p->rates[p->next_rate];

                sample->at_us = now_us;
                sample->delivered = (p->delivered - then->delivered) * 1000000u / (now_us - then->at_us);
                p->next_rate = (p->next_rate + 1) % PACE_RATE_SAMPLES;
                if (p->n_rates < PACE_RATE_SAMPLES)
                        p->n_rates++;
        }
        if (!p->peak_window.at_us) {
                p->peak_window = (PaceMark) { .at_us = now_us, .delivered = p->delivered };
        } else if (now_us - p->peak_window.at_us >= PACE_PEAK_WINDOW_US) {
                uint64_t rate = (p->delivered - p->peak_window.delivered) * 1000000u / (now_us - p->peak_window.at_us);

                if (rate > p->rate_peak)
                        p->rate_peak = rate;
                p->peak_window = (PaceMark) { .at_us = now_us, .delivered = p->delivered };
        }
        p->marks[p->next_mark] = (PaceMark) { .at_us = now_us, .delivered = p->delivered };
        p->next_mark = (p->next_mark + 1) % PACE_DELIVERY_MARKS;
        if (p->n_marks < PACE_DELIVERY_MARKS)
                p->n_marks++;
}

uint64_t pace_rate(const Pace *p, uint64_t now_us) {
        uint64_t best = 0;

        for (unsigned k = 0; k < p->n_rates; k++) {
                const PaceMark *s = &p->rates[k];

                if (now_us - s->at_us <= RATE_PERIOD_US && s->delivered > best)
                        best = s->delivered;
        }
        return best;
}

uint64_t pace_rate_peak(const Pace *p) {
        return p->rate_peak;
}

void pace_note_peak(Pace *p, uint64_t rate) {
        if (rate > p->rate_peak)
                p->rate_peak = rate;
}

uint64_t pace_object_time_us(const Pace *p, uint64_t now_us) {
        uint64_t rate = pace_rate(p, now_us);

        return rate ? (uint64_t) (p->object_bytes * 1e6 / (double) rate) : 0;
}

/* The objects that fit in rate * rtt_min / divisor, at most pace_background_limit(); one before anything is
 * measured, as on a slow link before. */
static unsigned bdp_limit(const Pace *p, uint64_t now_us, uint64_t rate, double divisor) {
        uint64_t rtt = pace_rtt_min_us(p);
        unsigned limit = pace_background_limit(p, now_us);
        double n;

        if (!rate || !rtt || p->object_bytes < 1)
                return 1;
        n = (double) rate * (double) rtt / 1e6 / divisor / p->object_bytes;
        return n < (double) limit ? (unsigned) n : limit;
}

unsigned pace_demand_limit(const Pace *p, uint64_t now_us) {
        return bdp_limit(p, now_us, pace_rate(p, now_us), 2.0);
}

unsigned pace_ahead_limit(const Pace *p, uint64_t now_us) {
        /* By the link's sustained rate: the last second's, over a few round trips, can catch a token bucket's
         * burst (pace_rate_peak()), and then let objects run beside a waiting guest on a 10 Mbit/s link. */
        return bdp_limit(p, now_us, pace_rate_peak(p), 1.0);
}

unsigned pace_background_limit(const Pace *p, uint64_t now_us) {
        uint64_t rate = pace_rate(p, now_us), rtt = pace_rtt_min_us(p);
        double window, n;
        unsigned limit = PACE_MIN_TRANSFERS;

        if (rate && rtt && p->object_bytes >= 1) {
                window = (double) rate * (double) (rtt + PACE_TARGET_US) / 1e6;
                n = window / p->object_bytes;
                if (n > (double) p->max_transfers)
                        limit = p->max_transfers;
                else if (n > PACE_MIN_TRANSFERS)
                        limit = (unsigned) n + (n > (double) (unsigned) n);
        }
        return limit < p->max_transfers ? limit : p->max_transfers;
}

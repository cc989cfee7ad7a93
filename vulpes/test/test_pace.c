/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * pace.c on simulated links: a FIFO bottleneck of a given rate behind a given round-trip time, serving the
 * objects the pacer lets through.  The window must fill a fast link and stay at the minimum on a slow one,
 * where each queued background object is time a demand request would wait.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "pace.h"

enum { MAX_FLIGHT = 64 };

typedef struct Link {
        double rate;          /* bytes per µs */
        uint64_t rtt_us;
        uint64_t free_at;     /* when the bottleneck finishes what it has */
} Link;

typedef struct Flight {
        uint64_t started, first_byte, done;
        size_t bytes;
} Flight;

/* Runs `objects` transfers of `bytes` each through the pacer; returns the time the last one finished and
 * the largest number the pacer ever had in flight (ret_peak), and the mean queueing delay seen. */
static uint64_t simulate(Pace *p, Link *link, unsigned objects, size_t bytes, unsigned *ret_peak,
                         double *ret_queue_us) {
        Flight flight[MAX_FLIGHT];
        unsigned n = 0, started = 0, peak = 0;
        uint64_t now = 1000000;
        double queue_sum = 0;

        while (started < objects || n > 0) {
                unsigned limit = pace_background_limit(p, now);

                while (started < objects && n < limit && n < MAX_FLIGHT) {
                        uint64_t arrive = now + link->rtt_us / 2;
                        uint64_t send = arrive > link->free_at ? arrive : link->free_at;

                        link->free_at = send + (uint64_t) ((double) bytes / link->rate);
                        queue_sum += (double) (send - arrive);
                        flight[n++] = (Flight) { .started = now, .first_byte = send + link->rtt_us / 2,
                                                 .done = link->free_at + link->rtt_us / 2, .bytes = bytes };
                        started++;
                }
                if (n > peak)
                        peak = n;
                /* The next completion. */
                unsigned k = 0;

                for (unsigned i = 1; i < n; i++)
                        if (flight[i].done < flight[k].done)
                                k = i;
                now = flight[k].done;
                pace_delivered(p, flight[k].bytes);
                pace_completed(p, now, flight[k].first_byte - flight[k].started, flight[k].bytes);
                flight[k] = flight[--n];
        }
        *ret_peak = peak;
        *ret_queue_us = queue_sum / objects;
        return now;
}

static void test_starts_at_the_minimum(void **state) {
        Pace p;

        (void) state;
        pace_init(&p, 12);
        assert_int_equal(pace_background_limit(&p, 1000), PACE_MIN_TRANSFERS);
        assert_int_equal(pace_rate(&p, 1000), 0);
        assert_int_equal(pace_rate_peak(&p), 0);
        assert_int_equal(pace_rtt_min_us(&p), 0);
}

static void test_fills_a_fast_link(void **state) {
        Pace p;
        Link link = { .rate = 100e6 / 8 / 1e6, .rtt_us = 20000 };   /* 100 Mbit/s, 20 ms */
        unsigned peak;
        double queue;
        uint64_t took, ideal;

        (void) state;
        pace_init(&p, 12);
        took = simulate(&p, &link, 2000, 60000, &peak, &queue) - 1000000;
        ideal = (uint64_t) (2000.0 * 60000 / link.rate);
        /* Within 10 % of the link's time for the bytes: the window keeps it full. */
        assert_true(took < ideal * 11 / 10);
        /* About (rtt + target) * rate: 45 ms at 12.5 MB/s is 9.4 objects. */
        assert_in_range(pace_background_limit(&p, link.free_at), 9, 11);
        assert_in_range(pace_rtt_min_us(&p), 20000, 21000);
        assert_in_range(pace_rate(&p, link.free_at), 11000000, 13000000);
        /* The peak stays when the link goes quiet. */
        assert_in_range(pace_rate_peak(&p), 11000000, 14000000);
        assert_int_equal(pace_rate(&p, link.free_at + 2000000), 0);
        assert_in_range(pace_rate_peak(&p), 11000000, 14000000);
        /* The queue it keeps stays near the target. */
        assert_true(queue < 2.0 * PACE_TARGET_US);
        /* While a guest misses: half the bandwidth-delay product, 125 KB, is 2 objects. */
        assert_int_equal(pace_demand_limit(&p, link.free_at), 2);
}

static void test_slow_link_stays_at_the_minimum(void **state) {
        Pace p;
        Link link = { .rate = 1e6 / 8 / 1e6, .rtt_us = 20000 };     /* 1 Mbit/s, 20 ms */
        unsigned peak;
        double queue;
        uint64_t took, ideal;

        (void) state;
        pace_init(&p, 12);
        /* Nothing measured yet: one background transfer beside a guest's miss. */
        assert_int_equal(pace_demand_limit(&p, 1000), 1);
        took = simulate(&p, &link, 100, 60000, &peak, &queue) - 1000000;
        ideal = (uint64_t) (100.0 * 60000 / link.rate);
        assert_int_equal(peak, PACE_MIN_TRANSFERS);
        assert_true(took < ideal * 105 / 100);
        assert_in_range(pace_rate_peak(&p), 110000, 140000);
        /* While a guest misses: none (half the bandwidth-delay product is 1.25 KB). */
        assert_int_equal(pace_demand_limit(&p, link.free_at), 0);
        /* A demand request arriving now waits behind at most the objects in flight: about two. */
        assert_true(queue <= 60000 / link.rate * 1.01);
}

static void test_cap_and_forgetting(void **state) {
        Pace p;
        Link link = { .rate = 1000e6 / 8 / 1e6, .rtt_us = 50000 };  /* 1 Gbit/s, 50 ms: far above the cap */
        unsigned peak;
        double queue;

        (void) state;
        pace_init(&p, 12);
        simulate(&p, &link, 3000, 60000, &peak, &queue);
        assert_int_equal(peak, 12);
        assert_int_equal(pace_background_limit(&p, link.free_at), 12);
        /* A second later the rate has no recent sample: back to the minimum until it is measured again. */
        assert_int_equal(pace_background_limit(&p, link.free_at + 2000000), PACE_MIN_TRANSFERS);
        /* The round trip is the lowest of the last ten minutes: still the link's after nine, forgotten after
         * eleven once newer samples came in. */
        pace_completed(&p, link.free_at + 9 * 60000000ull, 80000, 60000);
        assert_int_equal(pace_rtt_min_us(&p), 50000);
        pace_completed(&p, link.free_at + 11 * 60000000ull, 90000, 60000);
        assert_int_equal(pace_rtt_min_us(&p), 80000);
        pace_completed(&p, link.free_at + 30 * 60000000ull, 95000, 60000);
        assert_int_equal(pace_rtt_min_us(&p), 95000);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_starts_at_the_minimum),
                cmocka_unit_test(test_fills_a_fast_link),
                cmocka_unit_test(test_slow_link_stays_at_the_minimum),
                cmocka_unit_test(test_cap_and_forgetting),
        };

        return cmocka_run_group_tests(tests, NULL, NULL);
}

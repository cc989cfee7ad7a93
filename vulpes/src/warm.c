/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The warmer: fills the kernel's page cache of the memory mount's `memory` file with the chunks that are here,
 * ahead of the guest.
 *
 * QEMU maps the guest's RAM from the memory mount, whose readahead is off (mount.c, main.c), so each first
 * touch of a page is one FUSE read: about 10,000 in the test workload after a resume, which then ran at 1.5×
 * its local time with every chunk in the cache, and at 1.1× with the file read into the page cache first
 * (BENCHMARKS.md, "warming the memory mount's page cache").  A page the kernel holds costs the guest a minor
 * fault, not a round trip through vulpes.
 *
 * So, once the guest has made `after_reads` reads (its first page faults after the resume, which the trace
 * must see one by one: they are the next resume pack, isrctl/pack.py), a thread asks the kernel to read
 * ahead (posix_fadvise(WILLNEED)) each chunk of the image that is in RAM or in the cache, in index order, and
 * again every WARM_RESCAN_MS for chunks that came since (a guest's read, readahead; from a hoard into the cache
 * every WARM_CACHE_ROUNDS of them); after each pass over those, the resume pack's pages that came since (vulpes
 * holds them before their chunks: the pages the guest touched after its previous resume), then the chunks
 * without a record (zeros: mostly RAM the guest had free, which it touches when it allocates: 1,200 FUSE reads
 * in the test workload), as long as the host has memory to spare (memory_to_spare()).  That fills the page
 * cache with the guest's whole RAM, as QEMU's own RAM would be once the guest used it; the kernel may take
 * clean pages back, and then the guest's touch is a read again.  A chunk QEMU punches (free page reporting) is
 * warmed again once the kernel has dropped its pages.
 * The kernel sends those reads from this thread: mount.c recognises them by the requesting thread's id and
 * serves them with image_warm_read(), which never fetches, loads nothing into vulpes's RAM and is not traced.
 * The kernel skips the pages it already holds (the guest's dirty pages among them), and a read of pages it
 * does not hold is their current content, so warming cannot undo a guest's write.
 *
 * What the trace misses: the guest's touches of warmed pages.  At a suspend, before the guest's pages are
 * dropped (daemon_invalidate(), which stops the warmer for good), isr asks for warm_trace_mapped(): the pages
 * of warmed chunks that QEMU has mapped, from its page tables, are traced with source `mapped`.  That set is
 * larger than what the guest touched (a read fault maps the cached pages around it too, the kernel's
 * fault-around) and has no order; the pages the guest touched before the warmer started, and those after the
 * suspend began, are exact.
 *
 * Pacing: at most WARM_INFLIGHT chunks are being read at once (cachestat() tells when a chunk's pages are in),
 * so that a guest's fault never queues behind more than a few of the warmer's reads.
 *
 * Threading: one thread; warm_served() and warm_is_own() from FUSE workers; warm_invalidator() from the control
 * thread; warm_trace_mapped() from the control thread.
 */
#define _GNU_SOURCE
#include "warm.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

enum {
        WARM_INFLIGHT = 4,                 /* chunks being read ahead at once */
        WARM_GIVE_UP_MS = 250,             /* a chunk whose pages do not all come (the kernel or vulpes left some
                                            * out) stops counting as in flight after this */
        WARM_RESCAN_MS = 100,              /* a round of passes found nothing new: look again after this, */
        WARM_CACHE_ROUNDS = 5,             /* ... into the cache only every this many rounds (a file system
                                            * lookup per chunk not in RAM: chunks a guest's read just brought
                                            * into RAM are warmed soon, while it touches their other pages) */
        WARM_POLL_MS = 50,                 /* how often the thread checks whether to start */
        WARM_NO_CACHESTAT_MS = 5,          /* without cachestat(), a request counts as done after this */
        PAGEMAP_BATCH = 4096,              /* pagemap entries read at once */
        ZEROS_CHECK = 32,                  /* chunks of zeros warmed between two looks at the host's memory */
        ZEROS_RESERVE_PERCENT = 25,        /* ... which must keep this much of it available */
};

#define PAGEMAP_PRESENT (UINT64_C(1) << 63)

typedef struct InFlight {
        uint64_t offset, len;
        uint64_t since_ns;
} InFlight;

/* What a pass goes over: the chunks with data that are here, the resume pack's pages, the chunks of zeros. */
typedef enum WarmPass {
        PASS_DATA,
        PASS_PACK,
        PASS_ZEROS,
        _PASS_MAX,
} WarmPass;

struct Warmer {
        Image *img;
        char *path;
        uint64_t after_reads;

        pthread_t thread;
        bool started;
        atomic_int tid;                    /* the thread's id once it runs, else 0 */

        /* Held around each fadvise, so that warm_invalidator() returns only once none can start. */
        pthread_mutex_t issue_lock;
        bool stopping;                     /* under issue_lock and lock */

        pthread_mutex_t lock;
        pthread_cond_t cond;               /* stopping, a request served */
        uint64_t served;                   /* requests served (so that the thread misses no wake-up) */

        /* The file, once the thread has started warming: its descriptor, its size and identity
         * (to find QEMU's mapping of it in /proc/PID/maps). */
        int fd;
        uint64_t size;
        dev_t dev;
        ino_t ino;
        bool opened;                       /* under lock */
};

static uint64_t now_ns(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

/* CLOCK_MONOTONIC (the condition's clock) ms from now. */
static struct timespec deadline_after_ms(unsigned ms) {
        uint64_t at = now_ns() + (uint64_t) ms * 1000000u;

        return (struct timespec) { .tv_sec = (time_t) (at / 1000000000u), .tv_nsec = (long) (at % 1000000000u) };
}

/* With lock held: waits up to ms for a change (stopping, a request served); true if stopping. */
static bool wait_locked(Warmer *w, unsigned ms) {
        struct timespec deadline = deadline_after_ms(ms);

        if (!w->stopping)
                pthread_cond_timedwait(&w->cond, &w->lock, &deadline);
        return w->stopping;
}

int warm_new(Image *img, const char *path, uint64_t after_reads, Warmer **ret) {
        pthread_condattr_t attr;
        Warmer *w;

        w = calloc(1, sizeof(*w));
        if (!w)
                return -ENOMEM;
        w->path = strdup(path);
        if (!w->path) {
                free(w);
                return -ENOMEM;
        }
        w->img = img;
        w->after_reads = after_reads;
        w->fd = -1;
        pthread_mutex_init(&w->issue_lock, NULL);
        pthread_mutex_init(&w->lock, NULL);
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&w->cond, &attr);
        pthread_condattr_destroy(&attr);
        *ret = w;
        return 0;
}

/*
 * Opens the file; -errno, with the warmer then idle for good.  vulpes must never map a file of its own mounts
 * (at an exit by SIGKILL, fuse_vma_close() writes the file back, which only vulpes could answer: the process
 * never ends, and QEMU waits on it), nor hold one that needs a flush at close (mount.c gives the warmer's
 * descriptor none).
 */
static int warm_open(Warmer *w) {
        struct stat st;
        int fd;

        fd = open(w->path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return -errno;
        if (fstat(fd, &st) < 0 || (uint64_t) st.st_size != image_size(w->img)) {
                close(fd);
                return -EIO;
        }
        pthread_mutex_lock(&w->lock);
        w->fd = fd;
        w->size = (uint64_t) st.st_size;
        w->dev = st.st_dev;
        w->ino = st.st_ino;
        w->opened = true;
        pthread_mutex_unlock(&w->lock);
        return 0;
}

/* cachestat(2) (Linux 6.5), which the C library may not wrap yet. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct warm_cachestat_range {
        uint64_t off, len;
};
struct warm_cachestat {
        uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

/* Whether every page of [start, start + len) is in the kernel's page cache; on a kernel without cachestat(),
 * once the request had WARM_NO_CACHESTAT_MS. */
static bool resident(Warmer *w, uint64_t start, uint64_t len, uint64_t since_ns) {
        uint64_t page = (uint64_t) sysconf(_SC_PAGESIZE), first = start / page, last;
        struct warm_cachestat_range range;
        struct warm_cachestat cs = { 0 };

        if (start + len > w->size)
                len = w->size - start;
        last = (start + len + page - 1) / page;
        range = (struct warm_cachestat_range) { .off = first * page, .len = (last - first) * page };
        if (syscall(__NR_cachestat, w->fd, &range, &cs, 0) < 0)
                return now_ns() - since_ns >= (uint64_t) WARM_NO_CACHESTAT_MS * 1000000u;
        return cs.nr_cache >= last - first;
}

/*
 * Whether the host can spare `bytes` more of page cache for zeros and still have ZEROS_RESERVE_PERCENT of its
 * memory available (/proc/meminfo): the guest may never touch that free RAM of its own, and the pages would push
 * out others (vulpes's cache files among them), so the zeros are warmed only where memory is plentiful.
 */
static bool memory_to_spare(uint64_t bytes) {
        unsigned long long total = 0, available = 0, value;
        char line[128], key[64];
        FILE *f = fopen("/proc/meminfo", "re");

        if (!f)
                return false;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "%63[^:]: %llu kB", key, &value) == 2) {
                        if (strcmp(key, "MemTotal") == 0)
                                total = value << 10;
                        else if (strcmp(key, "MemAvailable") == 0)
                                available = value << 10;
                }
        fclose(f);
        return available > bytes && available - bytes > total / 100 * ZEROS_RESERVE_PERCENT;
}

/* Asks the kernel to read [start, start + len) ahead; false once stopping. */
static bool issue(Warmer *w, uint64_t start, uint64_t len) {
        bool stopping;

        pthread_mutex_lock(&w->issue_lock);
        stopping = w->stopping;
        if (!stopping)
                (void) posix_fadvise(w->fd, (off_t) start, (off_t) len, POSIX_FADV_WILLNEED);
        pthread_mutex_unlock(&w->issue_lock);
        return !stopping;
}

static void *warm_thread(void *userdata) {
        Warmer *w = userdata;
        InFlight inflight[WARM_INFLIGHT];
        size_t n_inflight = 0;
        uint64_t cursors[_PASS_MAX] = { 0 }, chunk = image_chunk_size(w->img), offset, len;
        WarmPass pass = PASS_DATA;
        unsigned zeros = 0, round = 0;
        int r;

        atomic_store(&w->tid, (int) gettid());
        pthread_mutex_lock(&w->lock);
        while (image_traced_reads(w->img) < w->after_reads)
                if (wait_locked(w, WARM_POLL_MS)) {
                        pthread_mutex_unlock(&w->lock);
                        return NULL;
                }
        pthread_mutex_unlock(&w->lock);
        r = warm_open(w);
        if (r < 0) {
                log_warning("cannot warm the page cache of %s: %s", w->path, strerror(-r));
                return NULL;
        }
        log_debug("warming the page cache of %s after %" PRIu64 " reads", w->path, image_traced_reads(w->img));
        for (;;) {
                /* Room for one more chunk in flight: the oldest is in, or given up on. */
                while (n_inflight == WARM_INFLIGHT) {
                        size_t kept = 0;
                        uint64_t now = now_ns(), served;

                        pthread_mutex_lock(&w->lock);
                        served = w->served;
                        pthread_mutex_unlock(&w->lock);
                        for (size_t i = 0; i < n_inflight; i++)
                                if (!resident(w, inflight[i].offset, inflight[i].len, inflight[i].since_ns) &&
                                    now - inflight[i].since_ns < (uint64_t) WARM_GIVE_UP_MS * 1000000u)
                                        inflight[kept++] = inflight[i];
                        n_inflight = kept;
                        if (n_inflight < WARM_INFLIGHT)
                                break;
                        pthread_mutex_lock(&w->lock);
                        if (w->stopping || (w->served == served && wait_locked(w, 10))) {
                                pthread_mutex_unlock(&w->lock);
                                return NULL;
                        }
                        pthread_mutex_unlock(&w->lock);
                }
                if (pass == PASS_PACK) {
                        /* The pack only grows: its cursor goes on from where it was. */
                        r = image_warm_pack_next(w->img, &cursors[pass], &offset, &len);
                } else if (pass == PASS_ZEROS && zeros++ % ZEROS_CHECK == 0 && !memory_to_spare(ZEROS_CHECK * chunk)) {
                        r = -ENOMEM;
                } else {
                        r = image_warm_next(w->img, &cursors[pass],
                                            pass == PASS_ZEROS ? IMAGE_WARM_ZEROS
                                            : round % WARM_CACHE_ROUNDS ? IMAGE_WARM_RAM_ONLY : 0, &offset);
                        offset *= chunk;
                        len = chunk;
                }
                if (r < 0) {
                        if (pass != PASS_PACK)
                                cursors[pass] = 0;
                        pass = (WarmPass) ((pass + 1) % _PASS_MAX);
                        if (pass != PASS_DATA)
                                continue;
                        round++;
                        pthread_mutex_lock(&w->lock);
                        if (wait_locked(w, WARM_RESCAN_MS)) {
                                pthread_mutex_unlock(&w->lock);
                                return NULL;
                        }
                        pthread_mutex_unlock(&w->lock);
                        continue;
                }
                if (!issue(w, offset, len))
                        return NULL;
                inflight[n_inflight++] = (InFlight) { .offset = offset, .len = len, .since_ns = now_ns() };
        }
}

int warm_start(Warmer *w) {
        int r = -pthread_create(&w->thread, NULL, warm_thread, w);

        if (r == 0)
                w->started = true;
        return r;
}

bool warm_is_own(Warmer *w, pid_t tid) {
        return w && tid != 0 && atomic_load(&w->tid) == (int) tid;
}

void warm_served(Warmer *w) {
        pthread_mutex_lock(&w->lock);
        w->served++;
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
}

static void stop(Warmer *w) {
        pthread_mutex_lock(&w->issue_lock);
        pthread_mutex_lock(&w->lock);
        w->stopping = true;
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->lock);
        pthread_mutex_unlock(&w->issue_lock);
}

int warm_invalidator(void *warmer, DaemonImage id) {
        if (id == DAEMON_IMAGE_MEMORY)
                stop(warmer);
        return 0;
}

/* Finds the mappings of the warmer's file in /proc/PID/maps and traces their mapped pages of warmed chunks. */
int warm_trace_mapped(void *warmer, pid_t pid) {
        Warmer *w = warmer;
        uint64_t page = (uint64_t) sysconf(_SC_PAGESIZE), chunk = image_chunk_size(w->img), *entries = NULL;
        char path[64], *line = NULL;
        size_t line_size = 0;
        FILE *maps = NULL;
        int pagemap = -1, traced = 0, r = 0;
        dev_t dev;
        ino_t ino;

        pthread_mutex_lock(&w->lock);
        if (!w->opened) {
                pthread_mutex_unlock(&w->lock);
                return 0;                       /* never warmed: the trace saw every touch */
        }
        dev = w->dev;
        ino = w->ino;
        pthread_mutex_unlock(&w->lock);

        snprintf(path, sizeof(path), "/proc/%d/maps", (int) pid);
        maps = fopen(path, "re");
        snprintf(path, sizeof(path), "/proc/%d/pagemap", (int) pid);
        pagemap = open(path, O_RDONLY | O_CLOEXEC);
        entries = malloc(PAGEMAP_BATCH * sizeof(*entries));
        if (!maps || pagemap < 0 || !entries) {
                r = !entries ? -ENOMEM : -errno;
                goto out;
        }
        while (getline(&line, &line_size, maps) > 0) {
                unsigned long long start, end, offset, inode;
                unsigned major, minor;

                if (sscanf(line, "%llx-%llx %*s %llx %x:%x %llu", &start, &end, &offset, &major, &minor, &inode) != 6 ||
                    makedev(major, minor) != dev || (ino_t) inode != ino)
                        continue;
                for (uint64_t first = start / page, last = end / page; first < last;) {
                        size_t n = last - first > PAGEMAP_BATCH ? PAGEMAP_BATCH : (size_t) (last - first);
                        ssize_t got = pread(pagemap, entries, n * sizeof(*entries), (off_t) (first * sizeof(*entries)));

                        if (got <= 0) {
                                r = got < 0 ? -errno : -EIO;
                                goto out;
                        }
                        n = (size_t) got / sizeof(*entries);
                        for (size_t i = 0; i < n; i++) {
                                uint64_t pos = offset + (first + i - start / page) * page;

                                if ((entries[i] & PAGEMAP_PRESENT) && pos < w->size &&
                                    image_warmed(w->img, pos / chunk)) {
                                        image_trace_mapped(w->img, pos, (size_t) page);
                                        traced++;
                                }
                        }
                        first += n;
                }
        }
out:
        free(line);
        free(entries);
        if (pagemap >= 0)
                close(pagemap);
        if (maps)
                fclose(maps);
        return r < 0 ? r : traced;
}

void warm_close(Warmer *w) {
        if (!w)
                return;
        stop(w);
        if (w->started)
                pthread_join(w->thread, NULL);
        w->started = false;
        if (w->fd >= 0)
                close(w->fd);
        w->fd = -1;
}

Warmer *warm_free(Warmer *w) {
        if (!w)
                return NULL;
        warm_close(w);
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->lock);
        pthread_mutex_destroy(&w->issue_lock);
        free(w->path);
        free(w);
        return NULL;
}

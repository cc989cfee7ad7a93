/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Talking to the server: chunk GETs and PUTs over HTTPS.  The only file that includes libcurl.
 *
 * One thread drives one curl multi handle, so connections (and their TLS sessions) are reused and, over
 * HTTP/2, every transfer is a stream on one connection.  Requests wait in one queue per priority; the
 * thread starts demand requests first, then uploads, and hoard requests only while fewer are running than
 * pace.c allows: about one bandwidth-delay product of them, so that a guest read, which is never held
 * back, also never waits behind more hoard bytes already on the link than that.  Idle requests (what a
 * session will likely need, streamed while the guest computes) start only when no demand request is
 * queued or running and none has finished for a quiet period, so they fill the link's idle time and keep
 * out of a guest's bursts of misses.  A GET for a tag that is already queued or in flight gets the
 * existing request's result (one transfer, many waiters), and moves up to the highest priority asked.
 *
 * Failures are sorted into transient (cannot connect, timeout, reset, 5xx, 429, 408, 401 after re-reading
 * the token, TLS trouble) and definitive (404/410: the chunk exists nowhere; bytes that fail the tag check
 * three times; other 4xx).  Transient ones are retried forever with capped exponential backoff, and the
 * status says the fetcher is waiting: a network outage must stall the guest, never fail its I/O.
 *
 * A transfer that receives nothing for LOW_SPEED_TIME_S is aborted, but over HTTP/2 that only resets its
 * stream: curl keeps the connection and puts the retry on it again.  A connection whose path died silently
 * (no RST, no FIN: a NAT or firewall that forgot it, a peer that hangs) would hold every request forever.
 * So the fetcher keeps the sockets curl opens, and when a transfer times out it shuts down every one that
 * has received nothing for SILENT_CONNECTION_MS (TCP_INFO), which makes curl drop the connection and open a
 * new one.  That is a little less than LOW_SPEED_TIME_S: a connection that stops answering usually received
 * its last bytes just after the transfers stuck on it began, so at their timeout it has been silent a little
 * less than they have (19.9 s of 20 in a benchmark's checkin), and an equal limit spared it until the next
 * timeout, 4 to 6 s later, every time.
 *
 * Redirects are followed by hand: a redirect to another origin (a presigned S3 URL) is requested without
 * the bearer token and without the server's pinned CA or key (its bytes are verified by tag anyway), so the
 * token never leaves the server it belongs to.
 *
 * Threading: the public functions may be called from any thread; callbacks run on the fetch thread and must
 * not call back into the fetcher's blocking functions.
 */
#define _GNU_SOURCE
#include "fetch.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <linux/sockios.h>

#include "chunk.h"
#include "file.h"
#include "hex.h"
#include "log.h"
#include "pace.h"

enum {
        BAD_BYTES_LIMIT = 3,               /* attempts that returned wrong bytes before giving up */
        REDIRECT_LIMIT = 5,
        BACKOFF_INITIAL_MS = 100,
        CONNECT_TIMEOUT_S = 10,
        LOW_SPEED_TIME_S = 20,             /* a transfer that moves nothing this long is aborted and retried */
        SILENT_CONNECTION_MS = LOW_SPEED_TIME_S * 1000 * 3 / 4,   /* at a timeout, shut down if this silent */
        IDLE_QUIET_MIN_US = 50000,         /* idle requests wait this long after a demand request, at least */
        TOKEN_MAX = 4096,
        SOCKETS_MAX = 64,                  /* sockets tracked for the silent-connection check */
        /* Uploads running at once, beside the max_transfers fetches: each is an HTTP/1.1 request on a
         * connection of its own (transfer_setup()), so what a checkin moves is bound by how many are in
         * flight: with 12, the test guest's 653 PUTs (mean 38 KB) took 49 ms each at 100 Mbit/s +20 ms,
         * 2.7 s for 24.8 MB that the link carries in 2.1 s (BENCHMARKS.md, "disk writes that do not wait,
         * uploads in flight"). */
        UPLOAD_TRANSFERS = 32,
        /* ...but on a slow link each of many uploads crawls, and one whose bytes all sit in the kernel's queue
         * for LOW_SPEED_TIME_S without an answer times out: at 1 Mbit/s with 32 running, a 131 KB object had a
         * 32nd of the link, 33 s, and the timeouts and reconnections cascaded.  How many may run follows how
         * long they take (upload_took()): one more after each that took less than UPLOAD_FAST_US and moved at
         * least UPLOAD_FLOW_RATE (small objects finish fast even on a slow link: at 1 Mbit/s the limit grew to
         * 26 on them, and some of those flows starved), half as many (at most once per UPLOAD_SLOW_US, at
         * least UPLOAD_TRANSFERS_MIN) after one that took longer than UPLOAD_SLOW_US or timed out;
         * UPLOAD_TRANSFERS_START at first. */
        UPLOAD_TRANSFERS_START = 12,
        UPLOAD_TRANSFERS_MIN = 4,
        UPLOAD_UNSENT = 16 * 1024,         /* see on_upload_socket() */
        OBJECT_MAX = CHUNK_SIZE_MAX + CHUNK_OVERHEAD,
};

#define UPLOAD_FAST_US UINT64_C(2000000)
#define UPLOAD_SLOW_US UINT64_C(8000000)
#define UPLOAD_FLOW_RATE UINT64_C(65536)   /* bytes/s */

typedef enum RequestKind {
        REQUEST_GET,
        REQUEST_PUT,
} RequestKind;

/* The queues: one per priority for GETs, one for uploads, and the running transfers. */
enum {
        QUEUE_DEMAND = FETCH_DEMAND,
        QUEUE_AHEAD = FETCH_AHEAD,
        QUEUE_SOON = FETCH_SOON,
        QUEUE_HOARD = FETCH_HOARD,
        QUEUE_IDLE = FETCH_IDLE,
        QUEUE_UPLOAD,
        QUEUE_ACTIVE,
        _QUEUE_MAX,
};

typedef struct Waiter {
        FetchDone done;
        void *userdata;
        struct Waiter *next;
} Waiter;

typedef struct Request {
        struct Request *prev, *next;
        int queue;
        RequestKind kind;
        FetchPriority priority;
        uint8_t tag[FETCH_TAG_LEN];
        char hex[FETCH_TAG_LEN * 2 + 1];
        Waiter *waiters;

        CURL *easy;
        struct curl_slist *headers;
        uint8_t *body;                     /* GET: the response; PUT: the object to send */
        size_t body_len, body_capacity, sent;
        bool overflow;
        uint64_t max_rate;

        char *redirect_url;                /* follow-up location after a redirect */
        bool foreign;                      /* redirect_url is another origin: no token, no pin */
        unsigned redirects;

        unsigned attempts, bad;
        uint64_t not_before_us;            /* backing off until then */
        uint64_t created_us;
        uint64_t started_us;               /* the current attempt went on the wire */
        uint64_t waiting_since_us;         /* first transient failure of the current run, 0 if none */
} Request;

typedef struct List {
        Request *head, *tail;
        unsigned n;
} List;

struct Fetcher {
        FetchConfig config;
        char *server_url;
        char *ca_file;
        char *pinned_key;
        char *token_file;
        char *auth_header;                 /* "Authorization: Bearer ..." */
        Stats *stats;

        pthread_mutex_t lock;
        List queues[_QUEUE_MAX];
        unsigned active_demand, active_hoard, active_upload;   /* hoard: with idle ones */
        unsigned upload_limit;             /* uploads that may run at once (UPLOAD_TRANSFERS) */
        uint64_t upload_cut_us;            /* when upload_limit was last halved */
        Request *completing;               /* out of the lists, its waiters being called (fetch thread) */
        uint64_t last_demand_us;           /* a demand request was queued or finished */
        Pace pace;                         /* how many hoard transfers may run (on the fetch thread) */
        bool offline;
        unsigned full_speed;               /* fetch_set_full_speed() calls that are on */
        bool restart_throttled;            /* the fetch thread restarts running uploads that have a rate */
        bool stopping;
        bool outage_logged;
        char last_error[200];

        CURLM *multi;
        pthread_t thread;
        bool thread_started;

        /* The TCP sockets curl opened and has not closed yet (fetch thread only). */
        int sockets[SOCKETS_MAX];
        unsigned n_sockets;
};

static uint64_t now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t) ts.tv_sec * 1000000u + (uint64_t) ts.tv_nsec / 1000u;
}

/* --- lists ------------------------------------------------------------------------------------------ */

static void list_append(List *l, Request *r, int queue) {
        r->prev = l->tail;
        r->next = NULL;
        if (l->tail)
                l->tail->next = r;
        else
                l->head = r;
        l->tail = r;
        l->n++;
        r->queue = queue;
}

static void list_remove(List *l, Request *r) {
        if (r->prev)
                r->prev->next = r->next;
        else
                l->head = r->next;
        if (r->next)
                r->next->prev = r->prev;
        else
                l->tail = r->prev;
        r->prev = r->next = NULL;
        l->n--;
}

static void request_move(Fetcher *f, Request *r, int queue) {
        list_remove(&f->queues[r->queue], r);
        list_append(&f->queues[queue], r, queue);
}

static Request *get_find(Fetcher *f, const uint8_t tag[FETCH_TAG_LEN]) {
        static const int searched[] = { QUEUE_DEMAND, QUEUE_AHEAD, QUEUE_SOON, QUEUE_HOARD, QUEUE_IDLE, QUEUE_ACTIVE };
        Request *c = f->completing;

        for (size_t i = 0; i < sizeof(searched) / sizeof(searched[0]); i++)
                for (Request *r = f->queues[searched[i]].head; r; r = r->next)
                        if (r->kind == REQUEST_GET && memcmp(r->tag, tag, FETCH_TAG_LEN) == 0)
                                return r;
        if (c && c->kind == REQUEST_GET && memcmp(c->tag, tag, FETCH_TAG_LEN) == 0)
                return c;
        return NULL;
}

static Request *request_free(Request *r) {
        if (!r)
                return NULL;
        while (r->waiters) {
                Waiter *w = r->waiters;

                r->waiters = w->next;
                free(w);
        }
        curl_slist_free_all(r->headers);
        free(r->body);
        free(r->redirect_url);
        free(r);
        return NULL;
}

/* --- configuration ---------------------------------------------------------------------------------- */

/* Reads the token file into auth_header; 0 if it changed, 1 if unchanged. */
static int token_load(Fetcher *f) {
        uint8_t *data = NULL;
        size_t len = 0;
        char *header = NULL;
        int r;

        r = file_read_all(f->token_file, TOKEN_MAX, &data, &len);
        if (r < 0)
                return r;
        while (len > 0 && (data[len - 1] == '\n' || data[len - 1] == '\r' || data[len - 1] == ' '))
                data[--len] = 0;
        if (len == 0 || memchr(data, '\n', len) || memchr(data, '\r', len) || strlen((char *) data) != len) {
                log_error("failed to read token file %s: it must hold one line", f->token_file);
                free(data);
                return -EINVAL;
        }
        if (asprintf(&header, "Authorization: Bearer %s", (char *) data) < 0) {
                free(data);
                return -ENOMEM;
        }
        free(data);
        if (f->auth_header && strcmp(f->auth_header, header) == 0) {
                free(header);
                return 1;
        }
        free(f->auth_header);
        f->auth_header = header;
        return 0;
}

/* scheme://host[:port] of url, for comparing origins. */
static size_t origin_len(const char *url) {
        const char *p = strstr(url, "://");

        if (!p)
                return strlen(url);
        p += 3;
        return (size_t) (p - url) + strcspn(p, "/?#");
}

static bool same_origin(const char *a, const char *b) {
        size_t la = origin_len(a), lb = origin_len(b);

        return la == lb && strncasecmp(a, b, la) == 0;
}

/* --- transfers -------------------------------------------------------------------------------------- */

static size_t on_body(char *data, size_t size, size_t nmemb, void *userdata) {
        Request *r = userdata;
        size_t len = size * nmemb;

        if (r->body_len + len > OBJECT_MAX) {
                r->overflow = true;
                return 0;
        }
        if (r->body_len + len > r->body_capacity) {
                size_t capacity = r->body_capacity ? r->body_capacity : 65536;
                uint8_t *p;

                while (capacity < r->body_len + len)
                        capacity *= 2;
                p = realloc(r->body, capacity);
                if (!p)
                        return 0;
                r->body = p;
                r->body_capacity = capacity;
        }
        memcpy(r->body + r->body_len, data, len);
        r->body_len += len;
        return len;
}

static size_t on_discard(char *data, size_t size, size_t nmemb, void *userdata) {
        (void) data;
        (void) userdata;
        return size * nmemb;
}

static size_t on_upload(char *buffer, size_t size, size_t nitems, void *userdata) {
        Request *r = userdata;
        size_t n = size * nitems;

        if (n > r->body_len - r->sent)
                n = r->body_len - r->sent;
        memcpy(buffer, r->body + r->sent, n);
        r->sent += n;
        return n;
}

/* --- sockets: curl opens and closes them through these, so that silent connections can be found --------- */

static curl_socket_t on_open_socket(void *userdata, curlsocktype purpose, struct curl_sockaddr *address) {
        Fetcher *f = userdata;
        int fd;

        (void) purpose;
        fd = socket(address->family, address->socktype | SOCK_CLOEXEC, address->protocol);
        if (fd < 0)
                return CURL_SOCKET_BAD;
        /* Untracked beyond SOCKETS_MAX: such a socket is only not checked. */
        if (address->socktype == SOCK_STREAM && (address->family == AF_INET || address->family == AF_INET6) &&
            f->n_sockets < SOCKETS_MAX)
                f->sockets[f->n_sockets++] = fd;
        return fd;
}

static int on_close_socket(void *userdata, curl_socket_t fd) {
        Fetcher *f = userdata;

        for (unsigned i = 0; i < f->n_sockets; i++)
                if (f->sockets[i] == fd) {
                        f->sockets[i] = f->sockets[--f->n_sockets];
                        break;
                }
        return close(fd);
}

/* The local port of a connected socket (what CURLINFO_LOCAL_PORT says of a transfer), 0 if unknown. */
static unsigned local_port(int fd) {
        struct sockaddr_storage addr;
        socklen_t len = sizeof(addr);

        if (getsockname(fd, (struct sockaddr *) &addr, &len) < 0)
                return 0;
        if (addr.ss_family == AF_INET)
                return ntohs(((struct sockaddr_in *) &addr)->sin_port);
        if (addr.ss_family == AF_INET6)
                return ntohs(((struct sockaddr_in6 *) &addr)->sin6_port);
        return 0;
}

/*
 * After a transfer timed out: shuts down every connection that has received nothing for nearly as long
 * (SILENT_CONNECTION_MS), so that curl sees it end and the retries go to a new one.  A live connection
 * carrying other transfers has received something lately and is left alone (an idle one goes too: curl
 * opens another when it needs one).  At debug level it first logs what the kernel says of each connection,
 * so that a log tells a path that went silent (data unacknowledged, retransmissions), a peer that stopped
 * reading (data unsent in the socket) and a stall above TCP (nothing queued either way: curl or the server
 * holding back) apart.
 */
static void close_silent_connections(Fetcher *f) {
        for (unsigned i = 0; i < f->n_sockets; i++) {
                struct tcp_info info;
                socklen_t len = sizeof(info);

                if (getsockopt(f->sockets[i], IPPROTO_TCP, TCP_INFO, &info, &len) < 0)
                        continue;
                if (log_enabled(LOG_DEBUG)) {
                        int unread = -1, queued = -1, unsent = -1;

                        (void) ioctl(f->sockets[i], SIOCINQ, &unread);
                        (void) ioctl(f->sockets[i], SIOCOUTQ, &queued);
                        (void) ioctl(f->sockets[i], SIOCOUTQNSD, &unsent);
                        log_debug("connection from port %u: last received %u ms ago, last sent %u ms ago; %d bytes "
                                  "unread, %d queued (%d of them unsent); %u segments unacknowledged, %u "
                                  "retransmits, backoff %u",
                                  local_port(f->sockets[i]), info.tcpi_last_data_recv, info.tcpi_last_data_sent,
                                  unread, queued, unsent, info.tcpi_unacked, info.tcpi_retransmits, info.tcpi_backoff);
                }
                if (info.tcpi_last_data_recv >= (unsigned) SILENT_CONNECTION_MS) {
                        log_debug("shutting down a connection that received nothing for %u ms",
                                  info.tcpi_last_data_recv);
                        (void) shutdown(f->sockets[i], SHUT_RDWR);
                }
        }
}

/*
 * At debug level: curl's account of its connections (opened, closed, found dead, told GOAWAY, a stream
 * refused, too many streams on one), which says why a fetcher has more than one connection and what became
 * of them.  Per-transfer lines (headers, stream ids, a connection reused or left intact) are left out: the
 * fetcher's own debug line per transfer names its connection by local port.
 */
static int on_curl_debug(CURL *easy, curl_infotype type, char *text, size_t len, void *userdata) {
        static const char *const kept[] = { "onnect", "GOAWAY", "REFUSED", "MAX_CONCURRENT", "dead", "PIPEWAIT",
                                            "multiplex" };
        static const char *const dropped[] = { "Re-using", "left intact", "Multiplexed connection found",
                                               "Found bundle" };
        char line[512];
        bool keep = false;

        (void) easy;
        (void) userdata;
        if (type != CURLINFO_TEXT)
                return 0;
        while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r'))
                len--;
        snprintf(line, sizeof(line), "%.*s", (int) (len < sizeof(line) ? len : sizeof(line) - 1), text);
        for (size_t i = 0; i < sizeof(kept) / sizeof(kept[0]) && !keep; i++)
                keep = strstr(line, kept[i]) != NULL;
        for (size_t i = 0; i < sizeof(dropped) / sizeof(dropped[0]) && keep; i++)
                keep = strstr(line, dropped[i]) == NULL;
        if (keep)
                log_debug("curl: %s", line);
        return 0;
}

/*
 * An upload's new connection keeps at most UPLOAD_UNSENT bytes unsent in the kernel (TCP_NOTSENT_LOWAT), so
 * that what curl counts as sent is what the link is carrying: with the kernel's autotuned buffer a whole
 * object went into the socket at once, and on a slow link shared with other uploads curl then saw no
 * progress while it drained (at 1 Mbit/s +20 ms: 131,100 bytes sent and 0 received after 25-55 s, while the
 * sockets of such uploads held 38-115 KB queued).  Timeouts remain there where one of several flows starves
 * (64 KiB sent, then nothing for 45 s; BENCHMARKS.md).  A socket that refuses it is used as it is.
 */
static int on_upload_socket(void *userdata, curl_socket_t fd, curlsocktype purpose) {
        int unsent = UPLOAD_UNSENT;

        (void) userdata;
        if (purpose == CURLSOCKTYPE_IPCXN)
                (void) setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &unsent, sizeof(unsent));
        return CURL_SOCKOPT_OK;
}

#define SETOPT(easy, opt, value)                                                                    \
        do {                                                                                        \
                CURLcode _c = curl_easy_setopt((easy), (opt), (value));                             \
                if (_c != CURLE_OK) {                                                               \
                        log_error("failed to set %s on a transfer: %s", #opt, curl_easy_strerror(_c)); \
                        return -EINVAL;                                                             \
                }                                                                                   \
        } while (0)

/* Builds the easy handle for the next attempt of r. */
static int transfer_setup(Fetcher *f, Request *r) {
        char url[4096];
        CURL *e;

        e = curl_easy_init();
        if (!e)
                return -ENOMEM;
        r->easy = e;
        if (r->redirect_url)
                snprintf(url, sizeof(url), "%s", r->redirect_url);
        else
                snprintf(url, sizeof(url), "%s/v1/chunks/%s", f->server_url, r->hex);

        SETOPT(e, CURLOPT_URL, url);
        SETOPT(e, CURLOPT_PRIVATE, r);
        SETOPT(e, CURLOPT_PROTOCOLS_STR, "https,http");
        SETOPT(e, CURLOPT_FOLLOWLOCATION, 0L);
        if (r->kind == REQUEST_PUT) {
                /* Uploads over HTTP/2 stalled with libcurl 7.88 (Debian 12): a PUT stream that had sent
                 * nothing sat for LOW_SPEED_TIME_S while its connection held the server's answer unread in
                 * the socket (TCP_INFO at the timeout: about 1 KB unread, received 40 ms after the last
                 * send), in about 1 checkin of 10 in the benchmarks (doc/vulpes.md, "What a stall looked
                 * like"); curl 8.1-8.2 fixed several such HTTP/2 upload stalls.  Each upload gets an HTTP/1.1
                 * connection of its own instead (kept for the next one), which also leaves its bytes out of
                 * HTTP/2's flow-control windows. */
                SETOPT(e, CURLOPT_HTTP_VERSION, (long) CURL_HTTP_VERSION_1_1);
        } else {
                SETOPT(e, CURLOPT_HTTP_VERSION, (long) CURL_HTTP_VERSION_2TLS);
                SETOPT(e, CURLOPT_PIPEWAIT, 1L);
        }
        SETOPT(e, CURLOPT_NOSIGNAL, 1L);
        SETOPT(e, CURLOPT_CONNECTTIMEOUT, (long) CONNECT_TIMEOUT_S);
        SETOPT(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
        SETOPT(e, CURLOPT_LOW_SPEED_TIME, (long) LOW_SPEED_TIME_S);
        SETOPT(e, CURLOPT_TCP_KEEPALIVE, 1L);
        SETOPT(e, CURLOPT_OPENSOCKETFUNCTION, on_open_socket);
        SETOPT(e, CURLOPT_OPENSOCKETDATA, f);
        SETOPT(e, CURLOPT_CLOSESOCKETFUNCTION, on_close_socket);
        SETOPT(e, CURLOPT_CLOSESOCKETDATA, f);
        SETOPT(e, CURLOPT_USERAGENT, "vulpes/0.1");
        if (log_enabled(LOG_DEBUG)) {
                SETOPT(e, CURLOPT_DEBUGFUNCTION, on_curl_debug);
                SETOPT(e, CURLOPT_VERBOSE, 1L);
        }

        curl_slist_free_all(r->headers);
        r->headers = NULL;
        if (!r->foreign) {
                /* The token goes only to the configured server, as a header we set per request. */
                r->headers = curl_slist_append(NULL, f->auth_header);
                if (!r->headers)
                        return -ENOMEM;
                SETOPT(e, CURLOPT_HTTPHEADER, r->headers);
                if (f->ca_file)
                        SETOPT(e, CURLOPT_CAINFO, f->ca_file);
                if (f->pinned_key) {
                        SETOPT(e, CURLOPT_PINNEDPUBLICKEY, f->pinned_key);
                        if (!f->ca_file) {
                                /* The pin alone authenticates the server (self-signed certificates). */
                                SETOPT(e, CURLOPT_SSL_VERIFYPEER, 0L);
                                SETOPT(e, CURLOPT_SSL_VERIFYHOST, 0L);
                        }
                }
        }

        if (r->kind == REQUEST_GET) {
                r->body_len = 0;
                r->overflow = false;
                SETOPT(e, CURLOPT_WRITEFUNCTION, on_body);
                SETOPT(e, CURLOPT_WRITEDATA, r);
        } else {
                r->sent = 0;
                SETOPT(e, CURLOPT_UPLOAD, 1L);
                SETOPT(e, CURLOPT_READFUNCTION, on_upload);
                SETOPT(e, CURLOPT_READDATA, r);
                SETOPT(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t) r->body_len);
                SETOPT(e, CURLOPT_WRITEFUNCTION, on_discard);
                SETOPT(e, CURLOPT_SOCKOPTFUNCTION, on_upload_socket);
                if (r->max_rate)
                        SETOPT(e, CURLOPT_MAX_SEND_SPEED_LARGE, (curl_off_t) r->max_rate);
        }
        return 0;
}

static void transfer_cleanup(Fetcher *f, Request *r) {
        if (r->easy) {
                curl_multi_remove_handle(f->multi, r->easy);
                curl_easy_cleanup(r->easy);
                r->easy = NULL;
        }
}

/*
 * Hands the result of r, which is out of the lists, to every waiter, then frees it; called without the lock
 * held.  Meanwhile r stays findable (get_find): a GET for its tag that comes while a waiter runs (a reader
 * that missed the cache just before a fetch ahead stored the object there) joins it instead of fetching
 * the object again, and is served here too.
 */
static void request_complete(Fetcher *f, Request *r, int result) {
        Waiter *w, *next;

        if (r->kind == REQUEST_GET && result == 0) {
                stats_add(&f->stats->fetches, 1);
                stats_add(&f->stats->fetch_bytes, r->body_len);
                stats_add_latency(f->stats, now_us() - r->created_us, r->priority == FETCH_DEMAND);
        } else if (r->kind == REQUEST_PUT && result == 0) {
                stats_add(&f->stats->uploads, 1);
                stats_add(&f->stats->upload_bytes, r->body_len);
        }
        pthread_mutex_lock(&f->lock);
        f->completing = r;
        while ((w = r->waiters)) {
                r->waiters = NULL;
                pthread_mutex_unlock(&f->lock);
                for (; w; w = next) {
                        next = w->next;
                        w->done(result, result == 0 && r->kind == REQUEST_GET ? r->body : NULL,
                                result == 0 && r->kind == REQUEST_GET ? r->body_len : 0, w->userdata);
                        free(w);
                }
                pthread_mutex_lock(&f->lock);
        }
        f->completing = NULL;
        pthread_mutex_unlock(&f->lock);
        request_free(r);
}

static uint64_t backoff_us(Fetcher *f, unsigned attempts) {
        uint64_t ms = BACKOFF_INITIAL_MS;

        while (attempts-- > 1 && ms < f->config.backoff_max_ms)
                ms *= 2;
        if (ms > f->config.backoff_max_ms)
                ms = f->config.backoff_max_ms;
        /* Up to 25 % jitter, so that many waiting requests do not retry in lockstep. */
        return ms * 1000u + (uint64_t) (rand() % (int) (ms * 250 + 1));
}

/* Puts r back in its queue to retry after a transient failure; with the lock held. */
static void request_retry_locked(Fetcher *f, Request *r, const char *why, bool outage) {
        uint64_t now = now_us();

        stats_add(&f->stats->fetch_retries, 1);
        snprintf(f->last_error, sizeof(f->last_error), "%s", why);
        if (!outage) {
                /* Bad bytes: ask again at once (logged per attempt by the caller); not an outage. */
                r->not_before_us = 0;
                request_move(f, r, r->kind == REQUEST_PUT ? QUEUE_UPLOAD : (int) r->priority);
                return;
        }
        r->attempts++;
        r->not_before_us = now + backoff_us(f, r->attempts);
        if (!r->waiting_since_us)
                r->waiting_since_us = now;
        if (!f->outage_logged) {
                log_warning("server trouble (%s): retrying, reads wait", why);
                f->outage_logged = true;
        }
        request_move(f, r, r->kind == REQUEST_PUT ? QUEUE_UPLOAD : (int) r->priority);
}

/*
 * Decides what one finished transfer means.  Returns 1 if r is complete (result in *ret_result), 2 to
 * follow a redirect, 0 to retry after a transient failure, 3 to retry at once after bad bytes.
 */
static int transfer_finish(Fetcher *f, Request *r, CURLcode code, int *ret_result) {
        long status = 0;
        char why[160];
        char *location = NULL;

        curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &status);

        if (code != CURLE_OK && !(code == CURLE_WRITE_ERROR && r->overflow)) {
                switch (code) {
                case CURLE_UNSUPPORTED_PROTOCOL:
                case CURLE_URL_MALFORMAT:
                case CURLE_NOT_BUILT_IN:
                        log_error("failed to fetch chunk %s: %s", r->hex, curl_easy_strerror(code));
                        *ret_result = -EIO;
                        return 1;
                case CURLE_PEER_FAILED_VERIFICATION:
                case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
                case CURLE_SSL_CACERT_BADFILE:
                        if (!f->outage_logged)
                                log_error("server certificate rejected (%s): not talking to it, retrying",
                                          curl_easy_strerror(code));
                        f->outage_logged = true;
                        /* fall through */
                default:
                        snprintf(why, sizeof(why), "%s", curl_easy_strerror(code));
                        return 0;
                }
        }
        if (r->overflow) {
                r->bad++;
                stats_add(&f->stats->fetch_bad, 1);
                snprintf(why, sizeof(why), "response for %s larger than any chunk object", r->hex);
                goto bad_bytes;
        }

        if (status >= 300 && status < 400 && status != 304) {
                curl_easy_getinfo(r->easy, CURLINFO_REDIRECT_URL, &location);
                if (!location || ++r->redirects > REDIRECT_LIMIT) {
                        log_error("failed to fetch chunk %s: bad redirect (HTTP %ld)", r->hex, status);
                        *ret_result = -EIO;
                        return 1;
                }
                char *copy = strdup(location);

                if (!copy) {
                        *ret_result = -ENOMEM;
                        return 1;
                }
                /* Once the chain has left the server's origin it never gets the token back. */
                r->foreign = r->foreign || !same_origin(copy, f->server_url);
                free(r->redirect_url);
                r->redirect_url = copy;
                return 2;
        }
        /* A redirect's target answers for one attempt only; the next attempt asks the server again. */
        free(r->redirect_url);
        r->redirect_url = NULL;
        r->foreign = false;
        r->redirects = 0;

        if (r->kind == REQUEST_PUT) {
                if (status == 200 || status == 201) {
                        *ret_result = 0;
                        return 1;
                }
                if (status == 422) {
                        log_error("failed to upload chunk %s: the server refused its bytes (HTTP 422)", r->hex);
                        *ret_result = -EBADMSG;
                        return 1;
                }
        } else if (status == 200) {
                if (chunk_verify_tag(r->body, r->body_len, r->tag) == 0) {
                        *ret_result = 0;
                        return 1;
                }
                r->bad++;
                stats_add(&f->stats->fetch_bad, 1);
                snprintf(why, sizeof(why), "chunk %s: the server sent bytes that do not match the tag", r->hex);
                goto bad_bytes;
        } else if (status == 404 || status == 410) {
                *ret_result = -ENOENT;
                return 1;
        }

        if (status == 401 && token_load(f) < 0) {
                snprintf(why, sizeof(why), "HTTP 401 and the token file cannot be read");
                return 0;
        }
        if (status == 401 || status == 403 || status == 408 || status == 429 || status >= 500) {
                snprintf(why, sizeof(why), "HTTP %ld", status);
                snprintf(f->last_error, sizeof(f->last_error), "%s", why);
                return 0;
        }
        log_error("failed to %s chunk %s: HTTP %ld", r->kind == REQUEST_GET ? "fetch" : "upload", r->hex, status);
        *ret_result = -EIO;
        return 1;

bad_bytes:
        log_warning("%s (attempt %u)", why, r->bad);
        snprintf(f->last_error, sizeof(f->last_error), "%s", why);
        if (r->bad >= BAD_BYTES_LIMIT) {
                *ret_result = -EBADMSG;
                return 1;
        }
        return 3;
}

static const char *priority_name(FetchPriority p) {
        static const char *const names[] = { "demand", "ahead", "soon", "hoard", "idle" };

        return (unsigned) p < _FETCH_PRIORITY_MAX ? names[p] : "?";
}

/* The counter of running transfers r belongs to. */
static unsigned *active_of(Fetcher *f, const Request *r) {
        if (r->kind == REQUEST_PUT)
                return &f->active_upload;
        return r->priority == FETCH_DEMAND ? &f->active_demand : &f->active_hoard;
}

/*
 * Whether idle requests may start: no demand request queued or running, and none for a quiet period (else
 * *ret_wait_us is how long until there will have been, UINT64_MAX while a guest waits).  The period is four
 * round trips, or four object transmission times where those are longer: an idle object on the link is
 * that long a wait for the guest's next miss, so on a slow link only a guest that has not missed for a
 * while (not one computing between misses) gets the link filled.
 */
static bool idle_may_start_locked(Fetcher *f, uint64_t now, uint64_t *ret_wait_us) {
        uint64_t quiet = 4 * pace_rtt_min_us(&f->pace), object = 4 * pace_object_time_us(&f->pace, now);

        if (quiet < object)
                quiet = object;
        if (quiet < IDLE_QUIET_MIN_US)
                quiet = IDLE_QUIET_MIN_US;
        *ret_wait_us = UINT64_MAX;
        if (f->queues[QUEUE_DEMAND].n || f->active_demand)
                return false;
        if (now < f->last_demand_us + quiet) {
                *ret_wait_us = f->last_demand_us + quiet - now;
                return false;
        }
        return true;
}

/* How many hoard and idle transfers may run: the pacer's window, but while a guest waits or just did only
 * what half a bandwidth-delay product holds (pace_demand_limit(): none on a slow link).  A resumed guest
 * misses in bursts, one page after another, and each miss queues behind whatever background bytes are on
 * the link (at 10 Mbit/s +20 ms, 61 misses before a guest answered took 7.7 s where they alone needed
 * 2.6 s; with no background at all while it missed, the workload at 100 Mbit/s took 2.5 times as long, its
 * stream stopped: BENCHMARKS.md, "demand first"). */
static unsigned background_limit_locked(Fetcher *f, uint64_t now) {
        uint64_t wait;

        if (!idle_may_start_locked(f, now, &wait))
                return pace_demand_limit(&f->pace, now);
        return pace_background_limit(&f->pace, now);
}

/* With the lock held: an upload of `len` bytes ended after `took` µs (UINT64_MAX: it timed out); see
 * UPLOAD_TRANSFERS. */
static void upload_took(Fetcher *f, size_t len, uint64_t took, uint64_t now) {
        if (took > UPLOAD_SLOW_US) {
                if (now - f->upload_cut_us > UPLOAD_SLOW_US) {
                        f->upload_limit = f->upload_limit / 2 > UPLOAD_TRANSFERS_MIN ? f->upload_limit / 2
                                                                                      : UPLOAD_TRANSFERS_MIN;
                        f->upload_cut_us = now;
                        if (took == UINT64_MAX)
                                log_debug("uploads: one timed out, at most %u at once now", f->upload_limit);
                        else
                                log_debug("uploads: one took %.1f s, at most %u at once now", (double) took / 1e6,
                                          f->upload_limit);
                }
        } else if (took < UPLOAD_FAST_US && (uint64_t) len * 1000000 >= UPLOAD_FLOW_RATE * took &&
                   f->upload_limit < UPLOAD_TRANSFERS) {
                f->upload_limit++;
        }
}

/* Starts every queued request that may start now; with the lock held.  Returns the µs until the next
 * backed-off request becomes ready (or a default poll interval). */
static uint64_t start_ready_locked(Fetcher *f) {
        uint64_t now = now_us(), next = 1000000, wait;
        static const int order[] = { QUEUE_DEMAND, QUEUE_UPLOAD, QUEUE_AHEAD, QUEUE_SOON, QUEUE_HOARD, QUEUE_IDLE };
        unsigned hoard_limit = background_limit_locked(f, now);
        /* Readahead is what a guest reading sequentially asks for next (its misses are these chunks, one
         * round trip each, if they queue behind the hoard): the pacer's window, and while a guest waits a
         * whole bandwidth-delay product where the hoard keeps to half (pace_ahead_limit()).  What a resumed
         * guest will likely touch soon is asked for only where a whole chunk fits in that product (image.c),
         * and has the whole window even then: held to one product while the guest missed, the test workload at
         * 100 Mbit/s +20 ms took 4.2-4.4 s, with the window 3.4-3.8. */
        unsigned soon_limit = pace_background_limit(&f->pace, now);
        unsigned ahead_limit = idle_may_start_locked(f, now, &wait) ? soon_limit : pace_ahead_limit(&f->pace, now);

        if (f->offline)
                return next;
        for (size_t q = 0; q < sizeof(order) / sizeof(order[0]); q++) {
                Request *r = f->queues[order[q]].head;

                if (order[q] == QUEUE_IDLE && r && !idle_may_start_locked(f, now, &wait)) {
                        if (wait < next)
                                next = wait;
                        break;
                }
                while (r) {
                        Request *following = r->next;

                        if (order[q] == QUEUE_UPLOAD ? f->active_upload >= f->upload_limit
                                                     : f->active_demand + f->active_hoard >= f->config.max_transfers)
                                break;
                        if ((order[q] == QUEUE_HOARD || order[q] == QUEUE_IDLE) && f->active_hoard >= hoard_limit)
                                break;
                        if (order[q] == QUEUE_AHEAD && f->active_hoard >= ahead_limit)
                                break;
                        if (order[q] == QUEUE_SOON && f->active_hoard >= soon_limit)
                                break;
                        if (r->not_before_us > now) {
                                if (r->not_before_us - now < next)
                                        next = r->not_before_us - now;
                                r = following;
                                continue;
                        }
                        if (transfer_setup(f, r) < 0 || curl_multi_add_handle(f->multi, r->easy) != CURLM_OK) {
                                transfer_cleanup(f, r);
                                r->not_before_us = now + 1000000;
                                r = following;
                                continue;
                        }
                        request_move(f, r, QUEUE_ACTIVE);
                        (*active_of(f, r))++;
                        r->started_us = now;
                        r = following;
                }
        }
        return next;
}

static void finished_transfers(Fetcher *f) {
        CURLMsg *msg;
        int left;

        while ((msg = curl_multi_info_read(f->multi, &left))) {
                Request *r = NULL;
                int result = 0, done;
                long port = 0;
                CURLcode code;

                if (msg->msg != CURLMSG_DONE)
                        continue;
                /* msg belongs to the easy handle: read it before transfer_cleanup() frees that. */
                code = msg->data.result;
                curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **) &r);
                pthread_mutex_lock(&f->lock);
                done = transfer_finish(f, r, code, &result);
                curl_easy_getinfo(r->easy, CURLINFO_LOCAL_PORT, &port);
                if (done == 1 && result == 0 && r->kind == REQUEST_GET) {
                        curl_off_t ttfb = 0;
                        uint64_t now = now_us();

                        curl_easy_getinfo(r->easy, CURLINFO_STARTTRANSFER_TIME_T, &ttfb);
                        pace_delivered(&f->pace, r->body_len);
                        pace_completed(&f->pace, now, ttfb > 0 ? (uint64_t) ttfb : 0, r->body_len);
                        /* What a demand miss waited for, and behind what: the figures bench/ reads. */
                        log_debug("GET %.12s %s %zu B: queued %.1f ms, first byte %.1f ms, done %.1f ms; "
                                  "running %u demand, %u background; connection from port %ld",
                                  r->hex, priority_name(r->priority), r->body_len,
                                  r->started_us > r->created_us ? (double) (r->started_us - r->created_us) / 1e3
                                                                : 0.0,
                                  (double) ttfb / 1e3,
                                  (double) (now - r->started_us) / 1e3, f->active_demand, f->active_hoard, port);
                } else if (done == 1 && result == 0) {
                        uint64_t now = now_us();

                        log_debug("PUT %.12s %zu B: queued %.1f ms, done %.1f ms; running %u uploads; connection "
                                  "from port %ld",
                                  r->hex, r->body_len, (double) (r->started_us - r->created_us) / 1e3,
                                  (double) (now - r->started_us) / 1e3, f->active_upload, port);
                        upload_took(f, r->body_len, now - r->started_us, now);
                } else if (code == CURLE_OPERATION_TIMEDOUT) {
                        curl_off_t sent = 0, received = 0;

                        curl_easy_getinfo(r->easy, CURLINFO_SIZE_UPLOAD_T, &sent);
                        curl_easy_getinfo(r->easy, CURLINFO_SIZE_DOWNLOAD_T, &received);
                        log_debug("%s %.12s timed out after %.1f s with %" CURL_FORMAT_CURL_OFF_T " bytes sent and "
                                  "%" CURL_FORMAT_CURL_OFF_T " received, on the connection from port %ld",
                                  r->kind == REQUEST_GET ? "GET" : "PUT", r->hex,
                                  (double) (now_us() - r->started_us) / 1e6, sent, received, port);
                        if (r->kind == REQUEST_PUT)
                                upload_took(f, r->body_len, UINT64_MAX, now_us());
                }
                transfer_cleanup(f, r);
                (*active_of(f, r))--;
                if (r->kind == REQUEST_GET && r->priority == FETCH_DEMAND)
                        f->last_demand_us = now_us();
                if (done == 1) {
                        list_remove(&f->queues[QUEUE_ACTIVE], r);
                        if (r->waiting_since_us || f->outage_logged) {
                                bool any_waiting = false;

                                for (int q = 0; q < _QUEUE_MAX && !any_waiting; q++)
                                        for (Request *o = f->queues[q].head; o; o = o->next)
                                                if (o->waiting_since_us) {
                                                        any_waiting = true;
                                                        break;
                                                }
                                if (!any_waiting && f->outage_logged && result == 0) {
                                        log_info("server reachable again");
                                        f->outage_logged = false;
                                        f->last_error[0] = 0;
                                }
                        }
                        pthread_mutex_unlock(&f->lock);
                        request_complete(f, r, result);
                        continue;
                }
                if (done == 2) {
                        /* Redirect: go again at once to the new location. */
                        request_move(f, r, r->kind == REQUEST_PUT ? QUEUE_UPLOAD : (int) r->priority);
                        r->not_before_us = 0;
                } else {
                        char why[200];

                        if (code == CURLE_OPERATION_TIMEDOUT)
                                close_silent_connections(f);
                        snprintf(why, sizeof(why), "%s", f->last_error[0] ? f->last_error : "transfer failed");
                        if (code != CURLE_OK)
                                snprintf(why, sizeof(why), "%s", curl_easy_strerror(code));
                        request_retry_locked(f, r, why, done == 0);
                }
                pthread_mutex_unlock(&f->lock);
        }
}

/* Restarts every running upload that has a rate, unthrottled; with the lock held, on the fetch thread. */
static void restart_throttled_locked(Fetcher *f) {
        Request *r = f->queues[QUEUE_ACTIVE].head, *next;

        f->restart_throttled = false;
        for (; r; r = next) {
                next = r->next;
                if (r->kind != REQUEST_PUT || !r->max_rate)
                        continue;
                transfer_cleanup(f, r);
                (*active_of(f, r))--;
                r->max_rate = 0;
                r->not_before_us = 0;
                request_move(f, r, QUEUE_UPLOAD);
        }
}

static void *fetch_thread(void *userdata) {
        Fetcher *f = userdata;

        for (;;) {
                uint64_t wait_us;
                int running;

                pthread_mutex_lock(&f->lock);
                if (f->stopping) {
                        pthread_mutex_unlock(&f->lock);
                        break;
                }
                if (f->restart_throttled)
                        restart_throttled_locked(f);
                wait_us = start_ready_locked(f);
                pthread_mutex_unlock(&f->lock);

                curl_multi_perform(f->multi, &running);
                finished_transfers(f);
                curl_multi_poll(f->multi, NULL, 0, (int) (wait_us / 1000 + 1), NULL);
        }
        return NULL;
}

/* --- public API ------------------------------------------------------------------------------------- */

int fetch_new(const FetchConfig *config, Stats *stats, Fetcher **ret) {
        Fetcher *f;
        long connections;
        int r;

        /* Not thread-safe: the daemon makes its one fetcher before starting other threads. */
        if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
                return -EIO;

        f = calloc(1, sizeof(*f));
        if (!f)
                return -ENOMEM;
        pthread_mutex_init(&f->lock, NULL);
        f->config = *config;
        f->stats = stats;
        f->offline = config->offline;
        if (!f->config.max_transfers)
                f->config.max_transfers = 16;
        f->upload_limit = UPLOAD_TRANSFERS_START;
        if (!f->config.hoard_transfers || f->config.hoard_transfers > f->config.max_transfers)
                f->config.hoard_transfers = f->config.max_transfers > 4 ? f->config.max_transfers - 4 : 1;
        pace_init(&f->pace, f->config.hoard_transfers);
        if (!f->config.backoff_max_ms)
                f->config.backoff_max_ms = 5000;
        f->server_url = strdup(config->server_url ? config->server_url : "");
        f->token_file = config->token_file ? strdup(config->token_file) : NULL;
        f->ca_file = config->ca_file ? strdup(config->ca_file) : NULL;
        f->pinned_key = config->pinned_key ? strdup(config->pinned_key) : NULL;
        if (!f->server_url || (config->token_file && !f->token_file) || (config->ca_file && !f->ca_file) ||
            (config->pinned_key && !f->pinned_key)) {
                r = -ENOMEM;
                goto out_free;
        }
        while (*f->server_url && f->server_url[strlen(f->server_url) - 1] == '/')
                f->server_url[strlen(f->server_url) - 1] = 0;
        if (f->token_file) {
                r = token_load(f);
                if (r < 0)
                        goto out_free;
        } else {
                f->auth_header = strdup("X-No-Token: 1");
        }

        f->multi = curl_multi_init();
        if (!f->multi) {
                r = -ENOMEM;
                goto out_free;
        }
        curl_multi_setopt(f->multi, CURLMOPT_PIPELINING, (long) CURLPIPE_MULTIPLEX);
        /* The fetches' HTTP/2 connection (more only while one is being set up) and one per upload. */
        connections = (long) (f->config.max_transfers + UPLOAD_TRANSFERS);
        curl_multi_setopt(f->multi, CURLMOPT_MAX_HOST_CONNECTIONS, connections);
        curl_multi_setopt(f->multi, CURLMOPT_MAXCONNECTS, connections);

        r = -pthread_create(&f->thread, NULL, fetch_thread, f);
        if (r < 0)
                goto out_free;
        f->thread_started = true;
        *ret = f;
        return 0;

out_free:
        fetch_free(f);
        return r;
}

Fetcher *fetch_free(Fetcher *f) {
        if (!f)
                return NULL;
        if (f->thread_started) {
                pthread_mutex_lock(&f->lock);
                f->stopping = true;
                pthread_mutex_unlock(&f->lock);
                curl_multi_wakeup(f->multi);
                pthread_join(f->thread, NULL);
        }
        for (int q = 0; q < _QUEUE_MAX; q++) {
                Request *r;

                while ((r = f->queues[q].head)) {
                        list_remove(&f->queues[q], r);
                        transfer_cleanup(f, r);
                        request_complete(f, r, -ECANCELED);
                }
        }
        if (f->multi)
                curl_multi_cleanup(f->multi);
        if (f->auth_header)
                memset(f->auth_header, 0, strlen(f->auth_header));
        free(f->auth_header);
        free(f->server_url);
        free(f->token_file);
        free(f->ca_file);
        free(f->pinned_key);
        pthread_mutex_destroy(&f->lock);
        free(f);
        return NULL;
}

static Request *request_new(RequestKind kind, const uint8_t tag[FETCH_TAG_LEN], FetchDone done, void *userdata) {
        Request *r = calloc(1, sizeof(*r));
        Waiter *w = calloc(1, sizeof(*w));

        if (!r || !w) {
                free(r);
                free(w);
                return NULL;
        }
        w->done = done;
        w->userdata = userdata;
        r->waiters = w;
        r->kind = kind;
        memcpy(r->tag, tag, FETCH_TAG_LEN);
        hex_encode(tag, FETCH_TAG_LEN, r->hex);
        r->created_us = now_us();
        return r;
}

int fetch_get(Fetcher *f, const uint8_t tag[FETCH_TAG_LEN], FetchPriority priority, FetchDone done, void *userdata) {
        Request *r;

        pthread_mutex_lock(&f->lock);
        if (f->stopping) {
                pthread_mutex_unlock(&f->lock);
                return -ECANCELED;
        }
        r = get_find(f, tag);
        if (r) {
                Waiter *w = calloc(1, sizeof(*w));

                if (!w) {
                        pthread_mutex_unlock(&f->lock);
                        return -ENOMEM;
                }
                w->done = done;
                w->userdata = userdata;
                w->next = r->waiters;
                r->waiters = w;
                if (priority < r->priority && r != f->completing) {
                        /* A guest now waits for what was a background request: it jumps the queue, and its
                         * latency (the statistics, the debug log's "queued") counts from now, from when a
                         * guest started waiting for it. */
                        if (priority == FETCH_DEMAND)
                                r->created_us = now_us();
                        if (r->queue != QUEUE_ACTIVE) {
                                request_move(f, r, (int) priority);
                                r->priority = priority;
                        } else {
                                (*active_of(f, r))--;
                                r->priority = priority;
                                (*active_of(f, r))++;
                        }
                }
                if (priority == FETCH_DEMAND)
                        f->last_demand_us = now_us();
                pthread_mutex_unlock(&f->lock);
                curl_multi_wakeup(f->multi);
                return 0;
        }
        r = request_new(REQUEST_GET, tag, done, userdata);
        if (!r) {
                pthread_mutex_unlock(&f->lock);
                return -ENOMEM;
        }
        r->priority = priority;
        list_append(&f->queues[priority], r, (int) priority);
        if (priority == FETCH_DEMAND)
                f->last_demand_us = now_us();
        pthread_mutex_unlock(&f->lock);
        curl_multi_wakeup(f->multi);
        return 0;
}

int fetch_put(Fetcher *f, const uint8_t tag[FETCH_TAG_LEN], const void *object, size_t len, uint64_t max_rate,
              FetchDone done, void *userdata) {
        Request *r;

        r = request_new(REQUEST_PUT, tag, done, userdata);
        if (!r)
                return -ENOMEM;
        r->body = malloc(len ? len : 1);
        if (!r->body) {
                request_free(r);
                return -ENOMEM;
        }
        memcpy(r->body, object, len);
        r->body_len = r->body_capacity = len;
        pthread_mutex_lock(&f->lock);
        if (f->stopping) {
                pthread_mutex_unlock(&f->lock);
                request_free(r);
                return -ECANCELED;
        }
        r->max_rate = f->full_speed ? 0 : max_rate;
        list_append(&f->queues[QUEUE_UPLOAD], r, QUEUE_UPLOAD);
        pthread_mutex_unlock(&f->lock);
        curl_multi_wakeup(f->multi);
        return 0;
}

typedef struct Completion {
        pthread_mutex_t lock;
        pthread_cond_t cond;
        bool done;
        int result;
        uint8_t *object;
        size_t len;
} Completion;

static void completion_done(int result, const uint8_t *object, size_t len, void *userdata) {
        Completion *c = userdata;
        uint8_t *copy = NULL;

        if (result == 0 && object) {
                copy = malloc(len);
                if (copy)
                        memcpy(copy, object, len);
                else
                        result = -ENOMEM;
        }
        pthread_mutex_lock(&c->lock);
        c->result = result;
        c->object = copy;
        c->len = len;
        c->done = true;
        pthread_cond_signal(&c->cond);
        pthread_mutex_unlock(&c->lock);
}

static int completion_wait(Completion *c) {
        pthread_mutex_lock(&c->lock);
        while (!c->done)
                pthread_cond_wait(&c->cond, &c->lock);
        pthread_mutex_unlock(&c->lock);
        pthread_mutex_destroy(&c->lock);
        pthread_cond_destroy(&c->cond);
        return c->result;
}

int fetch_get_wait(Fetcher *f, const uint8_t tag[FETCH_TAG_LEN], FetchPriority priority, uint8_t **ret_object,
                   size_t *ret_len) {
        Completion c = { .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER };
        int r;

        r = fetch_get(f, tag, priority, completion_done, &c);
        if (r < 0)
                return r;
        r = completion_wait(&c);
        if (r < 0)
                return r;
        *ret_object = c.object;
        *ret_len = c.len;
        return 0;
}

void fetch_set_full_speed(Fetcher *f, bool on) {
        pthread_mutex_lock(&f->lock);
        if (!on) {
                f->full_speed--;
                pthread_mutex_unlock(&f->lock);
                return;
        }
        f->full_speed++;
        for (Request *r = f->queues[QUEUE_UPLOAD].head; r; r = r->next)
                r->max_rate = 0;
        for (Request *r = f->queues[QUEUE_ACTIVE].head; r; r = r->next)
                if (r->kind == REQUEST_PUT && r->max_rate)
                        f->restart_throttled = true;
        pthread_mutex_unlock(&f->lock);
        curl_multi_wakeup(f->multi);
}

void fetch_set_offline(Fetcher *f, bool offline) {
        pthread_mutex_lock(&f->lock);
        f->offline = offline;
        pthread_mutex_unlock(&f->lock);
        curl_multi_wakeup(f->multi);
}

uint64_t fetch_bdp_bytes(Fetcher *f) {
        uint64_t bytes;

        pthread_mutex_lock(&f->lock);
        bytes = pace_rate_peak(&f->pace) * pace_rtt_min_us(&f->pace) / 1000000u;
        pthread_mutex_unlock(&f->lock);
        return bytes;
}

void fetch_note_rate(Fetcher *f, uint64_t rate) {
        pthread_mutex_lock(&f->lock);
        pace_note_peak(&f->pace, rate);
        pthread_mutex_unlock(&f->lock);
}

void fetch_status(Fetcher *f, FetchStatus *ret) {
        uint64_t now = now_us(), oldest = 0;

        memset(ret, 0, sizeof(*ret));
        pthread_mutex_lock(&f->lock);
        ret->offline = f->offline;
        ret->queued[FETCH_DEMAND] = f->queues[QUEUE_DEMAND].n;
        ret->queued[FETCH_AHEAD] = f->queues[QUEUE_AHEAD].n;
        ret->queued[FETCH_SOON] = f->queues[QUEUE_SOON].n;
        ret->queued[FETCH_HOARD] = f->queues[QUEUE_HOARD].n;
        ret->queued[FETCH_IDLE] = f->queues[QUEUE_IDLE].n;
        ret->active = f->queues[QUEUE_ACTIVE].n;
        ret->uploads = f->queues[QUEUE_UPLOAD].n + f->active_upload;
        for (int q = 0; q < _QUEUE_MAX; q++)
                for (Request *r = f->queues[q].head; r; r = r->next)
                        if (r->waiting_since_us && (!oldest || r->waiting_since_us < oldest))
                                oldest = r->waiting_since_us;
        ret->waiting = oldest != 0 || (f->offline && (f->queues[QUEUE_DEMAND].n || f->queues[QUEUE_HOARD].n));
        ret->waiting_seconds = oldest ? (now - oldest) / 1000000u : 0;
        ret->active_hoard = f->active_hoard;
        ret->hoard_limit = background_limit_locked(f, now);
        ret->rtt_min_us = pace_rtt_min_us(&f->pace);
        ret->rate = pace_rate(&f->pace, now);
        ret->rate_peak = pace_rate_peak(&f->pace);
        snprintf(ret->last_error, sizeof(ret->last_error), "%s", f->last_error);
        pthread_mutex_unlock(&f->lock);
}

/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The control socket: isrctl's way to steer a running daemon (hoard, flush, offline/online, writeback,
 * traces, status).  One JSON object per line, request and response, via jansson (with manifest.c, the
 * only files that include it).  Each connection gets a thread, because some requests (flush, upload,
 * hoard with "wait") block until their work is done and must not hold up a status query.
 *
 * Threading: one listener thread plus one detached thread per connection; control_stop() waits for
 * the connection threads to finish.
 */
#define _GNU_SOURCE
#include "control.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <jansson.h>

#include "crypto.h"
#include "file.h"
#include "log.h"
#include "pack.h"

enum {
        REQUEST_MAX = 16 << 20,       /* a hoard list of a million chunks fits */
        CONNECTIONS_MAX = 64,
};

typedef struct Connection Connection;

struct Control {
        Daemon *daemon;
        char *path;
        int listen_fd;
        int wake[2];
        pthread_t thread;
        bool thread_started;
        pthread_mutex_t lock;
        pthread_cond_t cond;
        unsigned connections;
        Connection *open[CONNECTIONS_MAX];
};

struct Connection {
        Control *control;
        int fd;
        size_t slot;
};

static json_t *error_response(const char *format, ...) __attribute__((format(printf, 1, 2)));
static json_t *error_response(const char *format, ...) {
        char text[256];
        json_t *message;
        va_list ap;

        va_start(ap, format);
        vsnprintf(text, sizeof(text), format, ap);
        va_end(ap);
        /* A JSON string is UTF-8, and the text may not be: it can quote a request's bytes (a parse error, an
         * unknown op) or end in a character cut in half.  Without a string there would be no answer at all. */
        message = json_string(text);
        if (!message) {
                for (char *p = text; *p; p++)
                        if ((unsigned char) *p >= 0x80)
                                *p = '?';
                message = json_string(text);
        }
        return json_pack("{s:b, s:o}", "ok", 0, "error", message);
}

static json_t *ok_response(void) {
        return json_pack("{s:b}", "ok", 1);
}

static json_t *op_status(Control *c) {
        char *text = NULL;
        size_t len = 0;
        json_t *status, *response;

        if (daemon_status_json(c->daemon, &text, &len) < 0)
                return error_response("out of memory");
        status = json_loadb(text, len, 0, NULL);
        free(text);
        if (!status)
                return error_response("internal error: bad status JSON");
        response = ok_response();
        json_object_set_new(response, "status", status);
        return response;
}

static bool is_all(json_t *value) {
        return json_is_string(value) && strcmp(json_string_value(value), "all") == 0;
}

/* One image's part of a hoard request: absent or "all" means everything, an array a list of indices, and
 * {"first": [...], "then": "all"} the list, then everything else. */
static int hoard_target(json_t *value, HoardTarget *ret) {
        size_t i;
        json_t *item;

        memset(ret, 0, sizeof(*ret));
        if (!value || is_all(value)) {
                ret->all = true;
                return 0;
        }
        if (json_is_object(value)) {
                json_t *then = json_object_get(value, "then");

                if (then && !is_all(then))
                        return -EINVAL;
                ret->all = then != NULL;
                value = json_object_get(value, "first");
        }
        if (!json_is_array(value))
                return -EINVAL;
        ret->indices = calloc(json_array_size(value) ? json_array_size(value) : 1, sizeof(uint64_t));
        if (!ret->indices)
                return -ENOMEM;
        json_array_foreach(value, i, item) {
                if (!json_is_integer(item) || json_integer_value(item) < 0) {
                        free(ret->indices);
                        ret->indices = NULL;
                        return -EINVAL;
                }
                ret->indices[ret->n++] = (uint64_t) json_integer_value(item);
        }
        return 0;
}

/* The image an op names in "image", or NULL. */
static Image *named_image(Control *c, json_t *request) {
        const char *name = json_string_value(json_object_get(request, "image"));

        for (int i = 0; name && i < _DAEMON_IMAGE_MAX; i++)
                if (strcmp(name, daemon_image_name((DaemonImage) i)) == 0)
                        return daemon_image(c->daemon, (DaemonImage) i);
        return NULL;
}

/*
 * {"op": "invalidate", "image": "memory"}: the kernel drops its cached pages of the image on every mount (and
 * unmaps them from QEMU), so that the guest's next touch of each faults again and the trace records it: isr
 * learns which pages a guest is using now, not only which it touched first (the resume pack's recent pages).
 */
static json_t *op_invalidate(Control *c, json_t *request) {
        const char *name = json_string_value(json_object_get(request, "image"));
        int r;

        for (int i = 0; name && i < _DAEMON_IMAGE_MAX; i++)
                if (strcmp(name, daemon_image_name((DaemonImage) i)) == 0) {
                        r = daemon_invalidate(c->daemon, (DaemonImage) i);
                        return r < 0 ? error_response("failed to invalidate the %s image: %s", name, strerror(-r))
                                     : ok_response();
                }
        return error_response("invalidate needs \"image\": disk or memory");
}

/*
 * {"op": "trace-mapped", "pid": N}: the pages of the memory image that process N (QEMU) has mapped in chunks
 * the warmer put into the kernel's page cache are traced with source "mapped" (warm.c): the guest touched
 * them without a read reaching the trace.  isr asks at a suspend, before "invalidate".  Answers {"pages": n}.
 */
static json_t *op_trace_mapped(Control *c, json_t *request) {
        json_t *pid = json_object_get(request, "pid"), *response;
        int r;

        if (!json_is_integer(pid) || json_integer_value(pid) <= 0 || json_integer_value(pid) > INT32_MAX)
                return error_response("trace-mapped needs \"pid\": a process id");
        r = daemon_trace_mapped(c->daemon, (pid_t) json_integer_value(pid));
        if (r == -ENOTSUP)
                r = 0;                  /* no warmer: every touch reached the trace */
        if (r < 0)
                return error_response("failed to trace the pages process %lld maps: %s",
                                      (long long) json_integer_value(pid), strerror(-r));
        response = ok_response();
        json_object_set_new(response, "pages", json_integer(r));
        return response;
}

/*
 * {"op": "preload", "image": "memory", "path": P, "part": N}: part N (default 0) of the resume pack of an
 * image, read from P (isr passes a memfd as /proc/<pid>/fd/<n>, so the plaintext never touches a disk).
 * {"op": "preload", "image": "memory", "end": true, "rate": R}: no more parts will come; they came at R bytes/s
 * (optional).
 */
static json_t *op_preload(Control *c, json_t *request) {
        const char *path = json_string_value(json_object_get(request, "path"));
        json_t *part = json_object_get(request, "part");
        Image *img = named_image(c, request);
        uint8_t *data;
        size_t len;
        int r;

        if (img && json_is_true(json_object_get(request, "end"))) {
                json_t *rate = json_object_get(request, "rate");

                if (rate && (!json_is_integer(rate) || json_integer_value(rate) < 0))
                        return error_response("preload's \"rate\" is the link's bytes per second, a whole number "
                                              "of 0 or more");
                image_preload_end(img, rate ? (uint64_t) json_integer_value(rate) : 0);
                return ok_response();
        }
        if (!img || !path || (part && (!json_is_integer(part) || json_integer_value(part) < 0 ||
                                       json_integer_value(part) >= IMAGE_PACKS_MAX)))
                return error_response("preload needs \"image\" (disk or memory), \"path\" and a \"part\" from 0 "
                                      "to %d, or \"end\": true", IMAGE_PACKS_MAX - 1);
        r = file_read_all(path, (size_t) (image_size(img) + (image_size(img) / 4096 + 1) *
                                          (PACK_EXTENT_LEN + PACK_MAP_LEN) + PACK_HEADER_V2_LEN), &data, &len);
        if (r < 0)
                return error_response("failed to read the resume pack %s: %s", path, strerror(-r));
        r = image_preload(img, data, len, part ? (uint32_t) json_integer_value(part) : 0);
        if (r < 0) {
                crypto_wipe(data, len);
                free(data);
                return error_response(r == -EBUSY ? "the %s image has that resume pack part already" :
                                      "the resume pack for the %s image is not valid", image_name(img));
        }
        return op_status(c);
}

static json_t *op_hoard(Control *c, json_t *request) {
        Hoard *h = daemon_hoard(c->daemon);
        HoardTarget targets[_DAEMON_IMAGE_MAX];
        bool lists = json_object_get(request, "disk") || json_object_get(request, "memory");
        json_t *priority = json_object_get(request, "priority");
        int r = 0;

        /* The request is checked before the daemon's state, so that a bad one says what is wrong with it. */
        if (priority && !(json_is_string(priority) && (strcmp(json_string_value(priority), "hoard") == 0 ||
                                                       strcmp(json_string_value(priority), "idle") == 0)))
                return error_response("\"priority\" must be \"hoard\" or \"idle\"");
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++) {
                json_t *value = json_object_get(request, daemon_image_name((DaemonImage) i));

                if (lists && !value) {
                        memset(&targets[i], 0, sizeof(targets[i]));
                        continue;
                }
                r = hoard_target(value, &targets[i]);
                if (r < 0) {
                        for (int j = 0; j < i; j++)
                                free(targets[j].indices);
                        return error_response("\"%s\" must be \"all\", an array of chunk indices or "
                                              "{\"first\": [...], \"then\": \"all\"}",
                                              daemon_image_name((DaemonImage) i));
                }
        }
        if (!h) {
                for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                        free(targets[i].indices);
                return error_response("no server is configured");
        }
        r = hoard_start(h, targets,
                        priority && strcmp(json_string_value(priority), "idle") == 0 ? FETCH_IDLE : FETCH_HOARD);
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                free(targets[i].indices);
        if (r < 0)
                return error_response("failed to start hoarding: %s", strerror(-r));
        if (json_is_true(json_object_get(request, "wait")))
                hoard_wait(h);
        return op_status(c);
}

static json_t *op_writeback(Control *c, json_t *request) {
        Writeback *w = daemon_writeback(c->daemon);
        json_t *enabled = json_object_get(request, "enabled"), *rate = json_object_get(request, "rate");

        if (!json_is_boolean(enabled) || (rate && (!json_is_integer(rate) || json_integer_value(rate) < 0)))
                return error_response("writeback needs \"enabled\": true|false and optionally \"rate\": bytes per second");
        if (!w)
                return error_response("no server is configured");
        writeback_set_trickle(w, json_is_true(enabled), rate ? (uint64_t) json_integer_value(rate) : 0);
        return ok_response();
}

static json_t *op_upload(Control *c) {
        Writeback *w = daemon_writeback(c->daemon);
        int64_t n;
        int r;
        json_t *response;

        if (!w)
                return error_response("no server is configured");
        r = daemon_flush(c->daemon);
        if (r < 0 && r != -ENOSPC && r != -EDQUOT)
                return error_response("failed to flush: %s", strerror(-r));
        n = writeback_upload_all(w);
        if (n < 0)
                return error_response("failed to upload: %s", strerror((int) -n));
        if (r < 0) {
                /* The cache had no room for the rest: what went to the server may be dropped now. */
                int64_t more;

                r = daemon_room_reclaim(c->daemon, true);
                if (r < 0)
                        return error_response("failed to flush: %s", strerror(-r));
                more = writeback_upload_all(w);
                if (more < 0)
                        return error_response("failed to upload: %s", strerror((int) -more));
                n += more;
        }
        response = ok_response();
        json_object_set_new(response, "uploaded", json_integer(n));
        return response;
}

static json_t *handle(Control *c, json_t *request) {
        const char *op = json_string_value(json_object_get(request, "op"));
        int r;

        if (!op)
                return error_response("a request is a JSON object with \"op\"");
        if (strcmp(op, "status") == 0)
                return op_status(c);
        if (strcmp(op, "flush") == 0) {
                r = daemon_flush(c->daemon);
                return r < 0 ? error_response("failed to flush: %s", strerror(-r)) : ok_response();
        }
        if (strcmp(op, "reclaim") == 0) {
                /* Room held for nothing given back; a flush that finds no room still answers (see the status). */
                r = daemon_room_reclaim(c->daemon, true);
                return r < 0 && r != -ENOSPC && r != -EDQUOT ? error_response("failed to reclaim room: %s", strerror(-r))
                                                             : op_status(c);
        }
        if (strcmp(op, "cache-limit") == 0) {
                json_t *limit = json_object_get(request, "limit");

                if (!json_is_integer(limit) || json_integer_value(limit) < 0)
                        return error_response("cache-limit needs \"limit\": bytes (0: none)");
                r = cache_set_limit(daemon_cache(c->daemon), (uint64_t) json_integer_value(limit));
                return r < 0 ? error_response("failed to set the cache limit: %s", strerror(-r)) : op_status(c);
        }
        if (strcmp(op, "invalidate") == 0)
                return op_invalidate(c, request);
        if (strcmp(op, "trace-mapped") == 0)
                return op_trace_mapped(c, request);
        if (strcmp(op, "hoard") == 0)
                return op_hoard(c, request);
        if (strcmp(op, "preload") == 0)
                return op_preload(c, request);
        if (strcmp(op, "hoard-stop") == 0) {
                if (!daemon_hoard(c->daemon))
                        return error_response("no server is configured");
                hoard_stop(daemon_hoard(c->daemon));
                return op_status(c);
        }
        if (strcmp(op, "offline") == 0 || strcmp(op, "online") == 0) {
                r = daemon_set_offline(c->daemon, strcmp(op, "offline") == 0);
                return r < 0 ? error_response("no server is configured") : ok_response();
        }
        if (strcmp(op, "writeback") == 0)
                return op_writeback(c, request);
        if (strcmp(op, "upload") == 0)
                return op_upload(c);
        if (strcmp(op, "trace-start") == 0) {
                const char *path = json_string_value(json_object_get(request, "path"));

                if (!path || path[0] != '/')
                        return error_response("trace-start needs \"path\": an absolute file name");
                r = daemon_trace_start(c->daemon, path);
                return r < 0 ? error_response("failed to open %s: %s", path, strerror(-r)) : ok_response();
        }
        if (strcmp(op, "trace-stop") == 0) {
                json_t *response = ok_response();

                json_object_set_new(response, "records", json_integer((json_int_t) trace_stop(daemon_trace(c->daemon))));
                return response;
        }
        if (strcmp(op, "checkin-done") == 0) {
                /* The keyrings are the version the server just committed, so it has every object they name:
                 * nothing is pending any more, and the cache may evict those objects. */
                for (int i = 0; i < _DAEMON_IMAGE_MAX; i++) {
                        r = image_changed_reset(daemon_image(c->daemon, (DaemonImage) i));
                        if (r >= 0)
                                r = image_uploads_clear(daemon_image(c->daemon, (DaemonImage) i));
                        if (r < 0)
                                return error_response("failed to reset the changed chunks: %s", strerror(-r));
                }
                return ok_response();
        }
        return error_response("unknown op \"%s\"", op);
}

char *control_answer(Control *c, const char *line, size_t len) {
        json_error_t error;
        json_t *request, *response;
        char *text;

        request = json_loadb(line, len, 0, &error);
        if (!request || !json_is_object(request))
                response = error_response("not a JSON object: %s", request ? "wrong type" : error.text);
        else
                response = handle(c, request);
        json_decref(request);
        text = json_dumps(response, JSON_COMPACT);
        json_decref(response);
        return text;
}

static int send_all(int fd, const char *p, size_t len) {
        while (len > 0) {
                ssize_t n = send(fd, p, len, MSG_NOSIGNAL);

                if (n < 0 && errno == EINTR)
                        continue;
                if (n < 0)
                        return -errno;
                p += n;
                len -= (size_t) n;
        }
        return 0;
}

static void *connection_thread(void *userdata) {
        Connection *conn = userdata;
        Control *c = conn->control;
        FILE *in = fdopen(dup(conn->fd), "r");
        char *line = NULL;
        size_t capacity = 0;
        ssize_t len;

        while (in && (len = getline(&line, &capacity, in)) > 0) {
                char *text;

                if (len > REQUEST_MAX)
                        break;
                text = control_answer(c, line, (size_t) len);
                if (!text || send_all(conn->fd, text, strlen(text)) < 0 || send_all(conn->fd, "\n", 1) < 0) {
                        free(text);
                        break;
                }
                free(text);
        }
        free(line);
        if (in)
                fclose(in);
        pthread_mutex_lock(&c->lock);
        c->open[conn->slot] = NULL;
        close(conn->fd);
        free(conn);
        c->connections--;
        pthread_cond_broadcast(&c->cond);
        pthread_mutex_unlock(&c->lock);
        return NULL;
}

static void *listen_thread(void *userdata) {
        Control *c = userdata;

        for (;;) {
                struct pollfd fds[2] = { { c->listen_fd, POLLIN, 0 }, { c->wake[0], POLLIN, 0 } };
                Connection *conn;
                pthread_t t;
                int fd;

                if (poll(fds, 2, -1) < 0) {
                        if (errno == EINTR)
                                continue;
                        break;
                }
                if (fds[1].revents)
                        break;
                fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
                if (fd < 0)
                        continue;
                conn = calloc(1, sizeof(*conn));
                if (!conn) {
                        close(fd);
                        continue;
                }
                conn->control = c;
                conn->fd = fd;
                pthread_mutex_lock(&c->lock);
                for (conn->slot = 0; conn->slot < CONNECTIONS_MAX && c->open[conn->slot]; conn->slot++)
                        ;
                if (conn->slot == CONNECTIONS_MAX) {
                        pthread_mutex_unlock(&c->lock);
                        close(fd);
                        free(conn);
                        continue;
                }
                c->open[conn->slot] = conn;
                c->connections++;
                pthread_mutex_unlock(&c->lock);
                if (pthread_create(&t, NULL, connection_thread, conn) != 0) {
                        pthread_mutex_lock(&c->lock);
                        c->open[conn->slot] = NULL;
                        close(fd);
                        free(conn);
                        c->connections--;
                        pthread_mutex_unlock(&c->lock);
                        continue;
                }
                pthread_detach(t);
        }
        return NULL;
}

int control_start(Daemon *d, const char *path, Control **ret) {
        struct sockaddr_un addr = { .sun_family = AF_UNIX };
        Control *c;
        int r;

        if (strlen(path) >= sizeof(addr.sun_path)) {
                log_error("failed to listen on %s: the path is too long for a Unix socket", path);
                return -ENAMETOOLONG;
        }
        c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        c->daemon = d;
        c->listen_fd = c->wake[0] = c->wake[1] = -1;
        pthread_mutex_init(&c->lock, NULL);
        pthread_cond_init(&c->cond, NULL);
        c->path = strdup(path);
        if (!c->path || pipe2(c->wake, O_CLOEXEC) < 0) {
                r = -ENOMEM;
                goto out_free;
        }
        strcpy(addr.sun_path, path);
        c->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (c->listen_fd < 0) {
                r = -errno;
                goto out_free;
        }
        unlink(path);
        if (bind(c->listen_fd, (struct sockaddr *) &addr, sizeof(addr)) < 0 || chmod(path, 0600) < 0 ||
            listen(c->listen_fd, 16) < 0) {
                r = -errno;
                log_error("failed to listen on %s: %s", path, strerror(-r));
                goto out_free;
        }
        r = -pthread_create(&c->thread, NULL, listen_thread, c);
        if (r < 0)
                goto out_free;
        c->thread_started = true;
        *ret = c;
        return 0;

out_free:
        control_stop(c);
        return r;
}

Control *control_stop(Control *c) {
        if (!c)
                return NULL;
        if (c->thread_started) {
                if (write(c->wake[1], "x", 1) < 0)
                        log_debug("failed to wake the control thread: %s", strerror(errno));
                pthread_join(c->thread, NULL);
        }
        if (c->listen_fd >= 0) {
                close(c->listen_fd);
                unlink(c->path);
        }
        /* A request in progress finishes (its answer is lost); an idle connection sees end-of-file. */
        pthread_mutex_lock(&c->lock);
        for (size_t i = 0; i < CONNECTIONS_MAX; i++)
                if (c->open[i])
                        shutdown(c->open[i]->fd, SHUT_RDWR);
        while (c->connections > 0)
                pthread_cond_wait(&c->cond, &c->lock);
        pthread_mutex_unlock(&c->lock);
        if (c->wake[0] >= 0)
                close(c->wake[0]);
        if (c->wake[1] >= 0)
                close(c->wake[1]);
        pthread_cond_destroy(&c->cond);
        pthread_mutex_destroy(&c->lock);
        free(c->path);
        free(c);
        return NULL;
}

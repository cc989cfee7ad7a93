/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The control socket (control.c): one request line, as isrctl sends it, answered by control_answer() of a
 * real daemon (empty keyrings at first, a cache in a temporary directory, no mount) with a real upstream: a
 * small HTTP/1.1 chunk server on loopback in this process (GET and PUT /v1/chunks/<tag>, one thread per
 * connection), so that hoard, writeback and upload requests run through fetch.c, the cache and the
 * keyrings instead of stopping at "no server".  Every answer must be a JSON object with a boolean "ok", and
 * a string "error" when it is false.
 *
 * Before each request the harness writes a little to the disk image (so that there is something to upload)
 * and deletes a few cached objects the server has (so that a hoard fetches them again); after it, it puts
 * the daemon back online and stops any hoard and trickle writeback, so that one input's "offline" cannot
 * make the next one's "wait" wait forever.
 *
 * Requests name files ("path" of trace-start and preload): the harness points any "path" at files in its
 * own temporary directory, so that the fuzzer cannot write or read elsewhere.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "control.h"
#include "daemon.h"
#define FUZZ_OWN_INITIALIZE
#include "fuzz.h"
#include "keyring.h"

enum {
        STORE_MAX = 4096,               /* objects the upstream keeps; PUTs beyond are answered but dropped */
        REQUEST_HEAD_MAX = 16384,
        DISK_DATA_CHUNKS = 16,          /* written at start-up, uploaded, then the upstream's to serve */
        MEMORY_DATA_CHUNKS = 4,
        CHUNK = 131072,
};

/* --- the upstream -------------------------------------------------------------------------------------- */

typedef struct Object {
        char tag[65];
        uint8_t *data;
        size_t len;
} Object;

static pthread_mutex_t store_lock = PTHREAD_MUTEX_INITIALIZER;
static Object store[STORE_MAX];
static size_t n_store;

static void store_put(const char *tag, uint8_t *data, size_t len) {
        pthread_mutex_lock(&store_lock);
        for (size_t i = 0; i < n_store; i++)
                if (strcmp(store[i].tag, tag) == 0) {
                        free(data);
                        pthread_mutex_unlock(&store_lock);
                        return;
                }
        if (n_store < STORE_MAX) {
                snprintf(store[n_store].tag, sizeof(store[n_store].tag), "%s", tag);
                store[n_store].data = data;
                store[n_store++].len = len;
        } else {
                free(data);
        }
        pthread_mutex_unlock(&store_lock);
}

/* A copy of the object named tag (NULL if there is none). */
static uint8_t *store_get(const char *tag, size_t *ret_len) {
        uint8_t *copy = NULL;

        pthread_mutex_lock(&store_lock);
        for (size_t i = 0; i < n_store; i++)
                if (strcmp(store[i].tag, tag) == 0) {
                        copy = malloc(store[i].len ? store[i].len : 1);
                        FUZZ_CHECK(copy, "out of memory");
                        memcpy(copy, store[i].data, store[i].len);
                        *ret_len = store[i].len;
                        break;
                }
        pthread_mutex_unlock(&store_lock);
        return copy;
}

static bool write_all(int fd, const void *data, size_t len) {
        const uint8_t *p = data;

        while (len > 0) {
                ssize_t n = send(fd, p, len, MSG_NOSIGNAL);

                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0)
                        return false;
                p += n;
                len -= (size_t) n;
        }
        return true;
}

static bool reply(int fd, const char *status, const void *body, size_t len) {
        char head[128];

        snprintf(head, sizeof(head), "HTTP/1.1 %s\r\nContent-Length: %zu\r\n\r\n", status, len);
        return write_all(fd, head, strlen(head)) && write_all(fd, body, len);
}

/* The 64 hex digits of path /v1/chunks/<tag>, or NULL. */
static const char *chunk_tag(const char *path) {
        const char *tag = path + strlen("/v1/chunks/");

        if (strncmp(path, "/v1/chunks/", strlen("/v1/chunks/")) != 0 || strspn(tag, "0123456789abcdef") != 64)
                return NULL;
        return tag;
}

/* Answers the requests of one connection until the client closes it. */
static void *serve_connection(void *userdata) {
        int fd = (int) (intptr_t) userdata;
        char buf[REQUEST_HEAD_MAX + 1];
        size_t have = 0;

        for (;;) {
                char method[8], path[160], tag[65], *end, *field;
                size_t head, length = 0, got;
                uint8_t *body;
                const char *t;

                buf[have] = 0;
                while (!(end = strstr(buf, "\r\n\r\n"))) {
                        ssize_t n;

                        if (have == REQUEST_HEAD_MAX)
                                goto out;
                        n = read(fd, buf + have, REQUEST_HEAD_MAX - have);
                        if (n <= 0)
                                goto out;
                        have += (size_t) n;
                        buf[have] = 0;
                }
                head = (size_t) (end - buf) + 4;
                end[2] = 0;                             /* the head, as a string; its fields in lower case */
                for (char *c = strstr(buf, "\r\n"); *c; c++)
                        *c = (char) tolower((unsigned char) *c);
                if (sscanf(buf, "%7s %159s", method, path) != 2)
                        goto out;
                field = strstr(buf, "\r\ncontent-length:");
                if (field)
                        length = strtoul(field + strlen("\r\ncontent-length:"), NULL, 10);
                if (length > 4u << 20)
                        goto out;
                if (strstr(buf, "\r\nexpect: 100-continue") && !write_all(fd, "HTTP/1.1 100 Continue\r\n\r\n", 25))
                        goto out;
                body = malloc(length + 1);
                FUZZ_CHECK(body, "out of memory");
                got = have - head < length ? have - head : length;
                memcpy(body, buf + head, got);
                memmove(buf, buf + head + got, have - head - got);
                have -= head + got;
                while (got < length) {
                        ssize_t n = read(fd, body + got, length - got);

                        if (n <= 0) {
                                free(body);
                                goto out;
                        }
                        got += (size_t) n;
                }
                t = chunk_tag(path);
                if (t)
                        snprintf(tag, sizeof(tag), "%.64s", t);
                if (t && strcmp(method, "PUT") == 0) {
                        store_put(tag, body, length);
                        if (!reply(fd, "201 Created", "{}", 2))
                                goto out;
                        continue;
                }
                free(body);
                if (t && strcmp(method, "GET") == 0) {
                        size_t len = 0;
                        uint8_t *object = store_get(tag, &len);
                        bool sent = object ? reply(fd, "200 OK", object, len) : reply(fd, "404 Not Found", "", 0);

                        free(object);
                        if (!sent)
                                goto out;
                        continue;
                }
                if (!reply(fd, "404 Not Found", "", 0))
                        goto out;
        }
out:
        close(fd);
        return NULL;
}

static void *serve(void *userdata) {
        int listener = (int) (intptr_t) userdata;

        for (;;) {
                pthread_t thread;
                int fd = accept(listener, NULL, NULL);

                if (fd < 0) {
                        if (errno == EINTR || errno == ECONNABORTED)
                                continue;
                        return NULL;
                }
                FUZZ_CHECK(pthread_create(&thread, NULL, serve_connection, (void *) (intptr_t) fd) == 0,
                           "cannot start a connection thread");
                pthread_detach(thread);
        }
}

/* Starts the upstream on a free loopback port; returns its URL. */
static void upstream_start(char *url, size_t size) {
        struct sockaddr_in address = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t len = sizeof(address);
        pthread_t thread;
        int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

        FUZZ_CHECK(listener >= 0 && bind(listener, (struct sockaddr *) &address, sizeof(address)) == 0 &&
                   listen(listener, 64) == 0 && getsockname(listener, (struct sockaddr *) &address, &len) == 0,
                   "cannot listen on loopback");
        FUZZ_CHECK(pthread_create(&thread, NULL, serve, (void *) (intptr_t) listener) == 0,
                   "cannot start the upstream");
        pthread_detach(thread);
        snprintf(url, size, "http://127.0.0.1:%u", (unsigned) ntohs(address.sin_port));
}

/* --- the daemon ---------------------------------------------------------------------------------------- */

static char dir[] = "/tmp/fuzz_control.XXXXXX";
static char cache_path[64], trace_file[64], pack_file[64];
static Daemon *daemon_;
static Control *control;
static unsigned inputs;

static void cleanup(void) {
        char command[128];

        control = control_stop(control);
        daemon_ = daemon_free(daemon_);
        snprintf(command, sizeof(command), "rm -rf -- '%s'", dir);
        if (system(command) != 0)
                fprintf(stderr, "failed to remove %s\n", dir);
}

/* control_answer() of a request the harness makes; returns whether it answered "ok": true. */
static bool ask(const char *request) {
        char *answer = control_answer(control, request, strlen(request));
        json_t *response = answer ? json_loads(answer, 0, NULL) : NULL;
        bool ok = json_is_true(json_object_get(response, "ok"));

        FUZZ_CHECK(answer, "no answer");
        json_decref(response);
        free(answer);
        return ok;
}

/* Fills chunks first..first+count of an image with bytes that vary with salt. */
static void write_chunks(DaemonImage image, unsigned first, unsigned count, uint32_t salt) {
        static uint8_t data[CHUNK];
        uint32_t x = salt * 2654435761u + 1;

        for (unsigned c = first; c < first + count; c++) {
                for (size_t i = 0; i < sizeof(data); i += 4) {
                        x ^= x << 13, x ^= x >> 17, x ^= x << 5;
                        memcpy(data + i, &x, 4);
                }
                FUZZ_CHECK(image_write(daemon_image(daemon_, image), data, sizeof(data), (uint64_t) c * CHUNK) ==
                           (ssize_t) sizeof(data), "cannot write to the image");
        }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        static const uint8_t pack[] = { 'I', 'S', 'R', 'P', 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
                                        0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 4, 'p', 'a', 'c', 'k' };
        char state[64], path[96], socket_path[64], url[64];
        DaemonConfig config = { 0 };
        Keyring *k;
        FILE *f;

        (void) argc;
        (void) argv;
        fuzz_quiet_logs();
        FUZZ_CHECK(mkdtemp(dir), "cannot make a temporary directory");
        snprintf(state, sizeof(state), "%s/state", dir);
        snprintf(cache_path, sizeof(cache_path), "%s/cache", dir);
        FUZZ_CHECK(mkdir(state, 0700) == 0, "cannot make the state directory");
        snprintf(path, sizeof(path), "%s/keyring.disk", state);
        FUZZ_CHECK(keyring_create(path, CHUNK, 64 << 20, &k) == 0, "cannot create the disk keyring");
        keyring_free(k);
        snprintf(path, sizeof(path), "%s/keyring.memory", state);
        FUZZ_CHECK(keyring_create(path, CHUNK, 16 << 20, &k) == 0, "cannot create the memory keyring");
        keyring_free(k);
        /* A one-extent pack of the memory image (16 MiB), for "preload". */
        snprintf(pack_file, sizeof(pack_file), "%s/pack", dir);
        f = fopen(pack_file, "w");
        FUZZ_CHECK(f && fwrite(pack, sizeof(pack), 1, f) == 1 && fclose(f) == 0, "cannot write the pack file");
        snprintf(trace_file, sizeof(trace_file), "%s/trace", dir);
        upstream_start(url, sizeof(url));

        config.state_dir = state;
        config.cache_dir = cache_path;
        config.server_url = url;
        config.ram_cache_bytes = 1 << 20;
        memcpy(config.keys, fuzz_key, 32);
        memcpy(config.keys + 32, fuzz_key, 32);
        FUZZ_CHECK(daemon_new(&config, &daemon_) == 0, "cannot start the daemon");
        snprintf(socket_path, sizeof(socket_path), "%s/control", dir);
        FUZZ_CHECK(control_start(daemon_, socket_path, &control) == 0, "cannot start the control socket");
        /* Data for the upstream to serve: written, uploaded, and made the base version. */
        write_chunks(DAEMON_IMAGE_DISK, 0, DISK_DATA_CHUNKS, 1);
        write_chunks(DAEMON_IMAGE_MEMORY, 0, MEMORY_DATA_CHUNKS, 2);
        FUZZ_CHECK(ask("{\"op\":\"upload\"}") && n_store == DISK_DATA_CHUNKS + MEMORY_DATA_CHUNKS,
                   "the start-up data did not reach the upstream");
        FUZZ_CHECK(ask("{\"op\":\"checkin-done\"}"), "checkin-done failed");
        /* Registered after OpenSSL's own exit handler, so that it runs first: daemon_free() flushes, which
         * seals what the last input wrote. */
        atexit(cleanup);
        return 0;
}

/* Deletes the cached copies of a few objects the upstream has, so that a hoard or a read fetches them. */
static void forget_some_objects(void) {
        char path[192];

        pthread_mutex_lock(&store_lock);
        for (size_t i = inputs % 4; i < n_store; i += 4) {
                snprintf(path, sizeof(path), "%s/chunks/%.2s/%.2s/%s", cache_path, store[i].tag, store[i].tag + 2,
                         store[i].tag);
                (void) unlink(path);
        }
        pthread_mutex_unlock(&store_lock);
}

/* The request with every "path" pointed into the harness's directory, or NULL to send it as it is. */
static char *confine_paths(const uint8_t *data, size_t size) {
        json_t *request = json_loadb((const char *) data, size, 0, NULL), *op;
        char *text = NULL;

        if (json_is_object(request) && json_object_get(request, "path")) {
                op = json_object_get(request, "op");
                json_object_set_new(request, "path",
                                    json_string(json_is_string(op) && strcmp(json_string_value(op), "preload") == 0 ?
                                                pack_file : trace_file));
                text = json_dumps(request, JSON_COMPACT);
                FUZZ_CHECK(text, "out of memory");
        }
        json_decref(request);
        return text;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        char *confined = confine_paths(data, size), *answer;
        json_t *response, *ok;

        inputs++;
        write_chunks(DAEMON_IMAGE_DISK, DISK_DATA_CHUNKS + inputs % 32, 1, inputs);
        forget_some_objects();
        answer = confined ? control_answer(control, confined, strlen(confined))
                          : control_answer(control, (const char *) data, size);
        FUZZ_CHECK(answer, "no answer");
        response = json_loads(answer, 0, NULL);
        FUZZ_CHECK(json_is_object(response), "the answer is not a JSON object");
        ok = json_object_get(response, "ok");
        FUZZ_CHECK(json_is_boolean(ok), "the answer has no boolean \"ok\"");
        FUZZ_CHECK(json_is_true(ok) || json_is_string(json_object_get(response, "error")),
                   "a refusal has no \"error\"");
        json_decref(response);
        free(answer);
        free(confined);
        /* Back to a daemon that talks to its server, with nothing running in the background. */
        FUZZ_CHECK(ask("{\"op\":\"online\"}") && ask("{\"op\":\"hoard-stop\"}") &&
                   ask("{\"op\":\"writeback\",\"enabled\":false}") && ask("{\"op\":\"cache-limit\",\"limit\":0}"),
                   "the harness could not reset the daemon");
        return 0;
}

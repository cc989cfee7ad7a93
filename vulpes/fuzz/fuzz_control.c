/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The control socket (control.c): one request line, as isrctl sends it, answered by control_answer() of a
 * real daemon (empty keyrings, a cache in a temporary directory, no server, no mount).  Every answer must
 * be a JSON object with a boolean "ok", and a string "error" when it is false.
 *
 * Requests name files ("path" of trace-start and preload): the harness points any "path" at files in its
 * own temporary directory, so that the fuzzer cannot write or read elsewhere.
 */
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "control.h"
#include "daemon.h"
#define FUZZ_OWN_INITIALIZE
#include "fuzz.h"
#include "keyring.h"

static char dir[] = "/tmp/fuzz_control.XXXXXX";
static char trace_file[64], pack_file[64];
static Daemon *daemon_;
static Control *control;

static void cleanup(void) {
        char command[128];

        control = control_stop(control);
        daemon_ = daemon_free(daemon_);
        snprintf(command, sizeof(command), "rm -rf -- '%s'", dir);
        if (system(command) != 0)
                fprintf(stderr, "failed to remove %s\n", dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        static const uint8_t pack[] = { 'I', 'S', 'R', 'P', 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
                                        0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 4, 'p', 'a', 'c', 'k' };
        char state[64], cache[64], path[96], socket_path[64];
        DaemonConfig config = { 0 };
        Keyring *k;
        FILE *f;

        (void) argc;
        (void) argv;
        fuzz_quiet_logs();
        FUZZ_CHECK(mkdtemp(dir), "cannot make a temporary directory");
        atexit(cleanup);
        snprintf(state, sizeof(state), "%s/state", dir);
        snprintf(cache, sizeof(cache), "%s/cache", dir);
        FUZZ_CHECK(mkdir(state, 0700) == 0, "cannot make the state directory");
        snprintf(path, sizeof(path), "%s/keyring.disk", state);
        FUZZ_CHECK(keyring_create(path, 131072, 64 << 20, &k) == 0, "cannot create the disk keyring");
        keyring_free(k);
        snprintf(path, sizeof(path), "%s/keyring.memory", state);
        FUZZ_CHECK(keyring_create(path, 131072, 16 << 20, &k) == 0, "cannot create the memory keyring");
        keyring_free(k);
        /* A one-extent pack of the memory image (16 MiB), for "preload". */
        snprintf(pack_file, sizeof(pack_file), "%s/pack", dir);
        f = fopen(pack_file, "w");
        FUZZ_CHECK(f && fwrite(pack, sizeof(pack), 1, f) == 1 && fclose(f) == 0, "cannot write the pack file");
        snprintf(trace_file, sizeof(trace_file), "%s/trace", dir);

        config.state_dir = state;
        config.cache_dir = cache;
        config.ram_cache_bytes = 1 << 20;
        memcpy(config.keys, fuzz_key, 32);
        memcpy(config.keys + 32, fuzz_key, 32);
        FUZZ_CHECK(daemon_new(&config, &daemon_) == 0, "cannot start the daemon");
        snprintf(socket_path, sizeof(socket_path), "%s/control", dir);
        FUZZ_CHECK(control_start(daemon_, socket_path, &control) == 0, "cannot start the control socket");
        return 0;
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
        return 0;
}

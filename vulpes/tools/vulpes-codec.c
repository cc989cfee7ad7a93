/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * vulpes-codec: the parcel format codecs of libvulpes_core on the command line, for cross-language tests
 * and for inspecting parcels by hand.  Binary data goes through files, keys are hex on argv, results are
 * `key=value` lines on stdout; a failure is one line on stderr and exit status 1 (2 for usage errors).
 * Set VULPES_CODEC_DEBUG=1 to see why the library rejected an input.
 *
 * Threading: single-threaded.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chunk.h"
#include "compress.h"
#include "crypto.h"
#include "envelope.h"
#include "file.h"
#include "hex.h"
#include "keyring.h"
#include "log.h"
#include "manifest.h"
#include "pack.h"
#include "seal.h"

#define FILE_MAX ((size_t) 1 << 32)

static const char usage_text[] =
        "usage: vulpes-codec COMMAND ARGS...\n"
        "  chunk-encode SECRET_HEX IN OUT                  prints tag=, key=, flags=, length=\n"
        "  chunk-decode TAG_HEX KEY_HEX LENGTH IN OUT\n"
        "  seal PK_HEX KIND IN OUT\n"
        "  open PK_HEX KIND MAXLEN IN OUT\n"
        "  envelope-wrap UUID_HEX PK_HEX CS_HEX (--passphrase-env VAR | --keyfile FILE)\n"
        "                [--log2n N --r R --p P] OUT\n"
        "  envelope-unwrap (--passphrase-env VAR | --keyfile FILE) IN\n"
        "                                                  prints uuid=, parcel_key=, convergence_secret=\n"
        "  keyring-import STREAM_FILE DB                   creates DB if it does not exist\n"
        "  keyring-export DB OUT\n"
        "  keyring-digest DB                               prints digest=, size=\n"
        "  keyring-wrap PK_HEX KEY_HEX                     prints wkey=\n"
        "  keyring-unwrap PK_HEX WKEY_HEX                  prints key=\n"
        "  manifest-open PK_HEX UUID VERSION IN            prints the fields vulpes reads\n"
        "  pack-parse IMAGE_SIZE IN                        prints extents=, bytes=, map=, map_parts= (a resume\n"
        "                                                  pack payload), parts_max=\n";

/* Prints the one-line error and returns the exit status for a failure. */
static int fail(int r, const char *format, ...) __attribute__((format(printf, 2, 3)));
static int fail(int r, const char *format, ...) {
        va_list ap;

        fputs("vulpes-codec: ", stderr);
        va_start(ap, format);
        vfprintf(stderr, format, ap);
        va_end(ap);
        if (r < 0)
                fprintf(stderr, ": %s", strerror(-r));
        fputc('\n', stderr);
        return 1;
}

static int usage_error(const char *what) {
        fprintf(stderr, "vulpes-codec: %s (run without arguments for usage)\n", what);
        return 2;
}

static void print_hex(const char *key, const void *data, size_t len) {
        char *s = malloc(2 * len + 1);

        if (!s)
                abort();
        hex_encode(data, len, s);
        printf("%s=%s\n", key, s);
        free(s);
}

static bool parse_u64(const char *s, uint64_t *ret) {
        char *end;

        if (!*s || *s == '-')
                return false;
        errno = 0;
        *ret = strtoull(s, &end, 10);
        return errno == 0 && *end == 0;
}

static bool parse_hex_key(const char *s, uint8_t *ret, size_t len) {
        return hex_decode_exact(s, ret, len) == 0;
}

static int cmd_chunk_encode(int argc, char **argv) {
        uint8_t secret[CHUNK_SECRET_LEN], tag[CHUNK_TAG_LEN], key[CHUNK_KEY_LEN], flags = 0, *in = NULL, *object;
        size_t in_len = 0, object_len = 0;
        int r, status;

        if (argc != 3)
                return usage_error("chunk-encode takes SECRET_HEX IN OUT");
        if (!parse_hex_key(argv[0], secret, sizeof(secret)))
                return usage_error("SECRET_HEX must be 64 hex digits");
        r = file_read_all(argv[1], CHUNK_SIZE_MAX, &in, &in_len);
        if (r < 0)
                return fail(r, "failed to read %s", argv[1]);
        object = malloc(chunk_object_max_len(in_len));
        if (!object)
                abort();
        r = chunk_encode(in, in_len, secret, COMPRESS_LEVEL_DEFAULT, object, &object_len, tag, key, &flags);
        if (r < 0) {
                status = fail(r, "failed to encode chunk");
                goto out;
        }
        r = file_write_atomic(argv[2], object, object_len, 0644);
        if (r < 0) {
                status = fail(r, "failed to write %s", argv[2]);
                goto out;
        }
        print_hex("tag", tag, sizeof(tag));
        print_hex("key", key, sizeof(key));
        printf("flags=%u\nlength=%zu\n", flags, object_len);
        status = 0;
out:
        free(object);
        free(in);
        return status;
}

static int cmd_chunk_decode(int argc, char **argv) {
        uint8_t tag[CHUNK_TAG_LEN], key[CHUNK_KEY_LEN], *in = NULL, *out;
        uint64_t n;
        size_t in_len = 0;
        int r, status;

        if (argc != 5)
                return usage_error("chunk-decode takes TAG_HEX KEY_HEX LENGTH IN OUT");
        if (!parse_hex_key(argv[0], tag, sizeof(tag)) || !parse_hex_key(argv[1], key, sizeof(key)))
                return usage_error("TAG_HEX and KEY_HEX must be 64 hex digits");
        if (!parse_u64(argv[2], &n) || n == 0 || n > CHUNK_SIZE_MAX)
                return usage_error("LENGTH must be 1 to 4194304");
        r = file_read_all(argv[3], compress_bound(CHUNK_SIZE_MAX) + CHUNK_OVERHEAD, &in, &in_len);
        if (r < 0)
                return fail(r, "failed to read %s", argv[3]);
        out = malloc(n);
        if (!out)
                abort();
        r = chunk_decode(in, in_len, tag, key, n, out);
        if (r < 0) {
                status = fail(r, "failed to decode chunk %s", argv[3]);
                goto out;
        }
        r = file_write_atomic(argv[4], out, n, 0600);
        if (r < 0) {
                status = fail(r, "failed to write %s", argv[4]);
                goto out;
        }
        printf("length=%" PRIu64 "\n", n);
        status = 0;
out:
        free(out);
        free(in);
        return status;
}

static bool parse_kind(const char *s, SealKind *ret) {
        uint64_t v;

        if (!parse_u64(s, &v) || v < SEAL_KIND_MANIFEST || v > SEAL_KIND_BOOT_FILE)
                return false;
        *ret = (SealKind) v;
        return true;
}

static int cmd_seal(int argc, char **argv) {
        uint8_t pk[SEAL_PARCEL_KEY_LEN], *in = NULL, *blob = NULL;
        size_t in_len = 0, blob_len = 0;
        SealKind kind;
        int r, status;

        if (argc != 4)
                return usage_error("seal takes PK_HEX KIND IN OUT");
        if (!parse_hex_key(argv[0], pk, sizeof(pk)))
                return usage_error("PK_HEX must be 64 hex digits");
        if (!parse_kind(argv[1], &kind))
                return usage_error("KIND must be 1 to 4");
        r = file_read_all(argv[2], FILE_MAX, &in, &in_len);
        if (r < 0)
                return fail(r, "failed to read %s", argv[2]);
        r = seal_blob(pk, kind, in, in_len, COMPRESS_LEVEL_DEFAULT, &blob, &blob_len);
        if (r < 0) {
                status = fail(r, "failed to seal %s", argv[2]);
                goto out;
        }
        r = file_write_atomic(argv[3], blob, blob_len, 0644);
        if (r < 0) {
                status = fail(r, "failed to write %s", argv[3]);
                goto out;
        }
        printf("length=%zu\n", blob_len);
        status = 0;
out:
        free(blob);
        free(in);
        return status;
}

static int cmd_open(int argc, char **argv) {
        uint8_t pk[SEAL_PARCEL_KEY_LEN], *in = NULL, *payload = NULL;
        size_t in_len = 0, payload_len = 0;
        uint64_t max_length;
        SealKind kind;
        int r, status;

        if (argc != 5)
                return usage_error("open takes PK_HEX KIND MAXLEN IN OUT");
        if (!parse_hex_key(argv[0], pk, sizeof(pk)))
                return usage_error("PK_HEX must be 64 hex digits");
        if (!parse_kind(argv[1], &kind))
                return usage_error("KIND must be 1 to 4");
        if (!parse_u64(argv[2], &max_length))
                return usage_error("MAXLEN must be a decimal integer");
        r = file_read_all(argv[3], FILE_MAX, &in, &in_len);
        if (r < 0)
                return fail(r, "failed to read %s", argv[3]);
        r = seal_open(pk, in, in_len, kind, max_length, &payload, &payload_len);
        if (r < 0) {
                status = fail(r, "failed to open sealed blob %s", argv[3]);
                goto out;
        }
        r = file_write_atomic(argv[4], payload, payload_len, 0600);
        if (r < 0) {
                status = fail(r, "failed to write %s", argv[4]);
                goto out;
        }
        printf("length=%zu\n", payload_len);
        status = 0;
out:
        if (payload)
                crypto_wipe(payload, payload_len);
        free(payload);
        free(in);
        return status;
}

/* Parses --passphrase-env/--keyfile and the scrypt options; leaves the positional arguments in argv. */
typedef struct CredentialOptions {
        EnvelopeCredential credential;
        uint8_t *keyfile;
        EnvelopeScryptParams params;
        bool have_params;
        int n_positional;
        char **positional;
} CredentialOptions;

static int credential_options_parse(int argc, char **argv, bool allow_params, CredentialOptions *ret) {
        static const struct option options[] = {
                { "passphrase-env", required_argument, NULL, 'P' },
                { "keyfile", required_argument, NULL, 'k' },
                { "log2n", required_argument, NULL, 'n' },
                { "r", required_argument, NULL, 'r' },
                { "p", required_argument, NULL, 'p' },
                {},
        };
        const char *passphrase_var = NULL, *keyfile_path = NULL;
        uint64_t value;
        int c, r;

        *ret = (CredentialOptions) {
                .params = { ENVELOPE_SCRYPT_LOG2N_DEFAULT, ENVELOPE_SCRYPT_R_DEFAULT, ENVELOPE_SCRYPT_P_DEFAULT },
        };
        /* getopt_long wants argv[0] to be the program name: argv here starts at the command's name. */
        optind = 1;
        opterr = 0;
        while ((c = getopt_long(argc, argv, "", options, NULL)) >= 0) {
                switch (c) {
                case 'P':
                        passphrase_var = optarg;
                        break;
                case 'k':
                        keyfile_path = optarg;
                        break;
                case 'n':
                case 'r':
                case 'p':
                        if (!allow_params)
                                return usage_error("scrypt parameters are only for envelope-wrap");
                        if (!parse_u64(optarg, &value) || value > UINT32_MAX)
                                return usage_error("--log2n, --r and --p take decimal integers");
                        if (c == 'n')
                                ret->params.log2n = (unsigned) value;
                        else if (c == 'r')
                                ret->params.r = (uint32_t) value;
                        else
                                ret->params.p = (uint32_t) value;
                        ret->have_params = true;
                        break;
                default:
                        return usage_error("unknown option");
                }
        }
        if (!!passphrase_var == !!keyfile_path)
                return usage_error("give exactly one of --passphrase-env VAR and --keyfile FILE");
        if (ret->have_params && keyfile_path)
                return usage_error("scrypt parameters do not apply to a key file");

        if (passphrase_var) {
                const char *passphrase = getenv(passphrase_var);

                if (!passphrase)
                        return fail(0, "failed to read passphrase: environment variable %s is not set", passphrase_var);
                ret->credential = (EnvelopeCredential) { ENVELOPE_KDF_SCRYPT, passphrase, strlen(passphrase) };
        } else {
                size_t len = 0;

                r = file_read_all(keyfile_path, ENVELOPE_KEYFILE_MAX, &ret->keyfile, &len);
                if (r < 0)
                        return fail(r, "failed to read key file %s", keyfile_path);
                ret->credential = (EnvelopeCredential) { ENVELOPE_KDF_KEYFILE, ret->keyfile, len };
        }
        ret->n_positional = argc - optind;
        ret->positional = argv + optind;
        return 0;
}

static void credential_options_done(CredentialOptions *o) {
        if (o->keyfile)
                crypto_wipe(o->keyfile, o->credential.secret_len);
        free(o->keyfile);
}

static int cmd_envelope_wrap(int argc, char **argv) {
        uint8_t uuid[ENVELOPE_UUID_LEN], pk[ENVELOPE_KEY_LEN], cs[ENVELOPE_KEY_LEN], envelope[ENVELOPE_LEN];
        CredentialOptions o;
        int r, status;

        status = credential_options_parse(argc, argv, true, &o);
        if (status != 0)
                return status;
        if (o.n_positional != 4) {
                status = usage_error("envelope-wrap takes UUID_HEX PK_HEX CS_HEX OUT");
                goto out;
        }
        if (!parse_hex_key(o.positional[0], uuid, sizeof(uuid)) || !parse_hex_key(o.positional[1], pk, sizeof(pk)) ||
            !parse_hex_key(o.positional[2], cs, sizeof(cs))) {
                status = usage_error("UUID_HEX must be 32 hex digits, PK_HEX and CS_HEX 64");
                goto out;
        }
        if (o.credential.kdf == ENVELOPE_KDF_SCRYPT && envelope_scrypt_params_check(&o.params) < 0) {
                status = usage_error("scrypt parameters out of range (log2n 10-22, r 1-32, p 1-16, at most 1 GiB)");
                goto out;
        }
        r = envelope_wrap(&o.credential, &o.params, uuid, pk, cs, envelope);
        if (r < 0) {
                status = fail(r, "failed to wrap key envelope");
                goto out;
        }
        r = file_write_atomic(o.positional[3], envelope, sizeof(envelope), 0600);
        if (r < 0) {
                status = fail(r, "failed to write %s", o.positional[3]);
                goto out;
        }
        printf("length=%d\n", ENVELOPE_LEN);
        status = 0;
out:
        crypto_wipe(pk, sizeof(pk));
        crypto_wipe(cs, sizeof(cs));
        credential_options_done(&o);
        return status;
}

static int cmd_envelope_unwrap(int argc, char **argv) {
        uint8_t uuid[ENVELOPE_UUID_LEN], pk[ENVELOPE_KEY_LEN], cs[ENVELOPE_KEY_LEN], *in = NULL;
        size_t in_len = 0;
        CredentialOptions o;
        int r, status;

        status = credential_options_parse(argc, argv, false, &o);
        if (status != 0)
                return status;
        if (o.n_positional != 1) {
                status = usage_error("envelope-unwrap takes IN");
                goto out;
        }
        r = file_read_all(o.positional[0], 1 << 20, &in, &in_len);
        if (r < 0) {
                status = fail(r, "failed to read %s", o.positional[0]);
                goto out;
        }
        r = envelope_unwrap(&o.credential, in, in_len, uuid, pk, cs);
        if (r < 0) {
                status = r == -EBADMSG ? fail(0, "failed to unwrap key envelope: wrong passphrase or key file, "
                                                 "or damaged envelope")
                                       : fail(r, "failed to unwrap key envelope");
                goto out;
        }
        print_hex("uuid", uuid, sizeof(uuid));
        print_hex("parcel_key", pk, sizeof(pk));
        print_hex("convergence_secret", cs, sizeof(cs));
        status = 0;
out:
        crypto_wipe(pk, sizeof(pk));
        crypto_wipe(cs, sizeof(cs));
        free(in);
        credential_options_done(&o);
        return status;
}

static int cmd_keyring_import(int argc, char **argv) {
        uint8_t *stream = NULL;
        size_t len = 0, n_decoded = 0;
        uint64_t n_records = 0, image_size = 0;
        uint32_t chunk_size = 0;
        KeyringRecord *records = NULL;
        Keyring *k = NULL;
        int r, status = 1;

        if (argc != 2)
                return usage_error("keyring-import takes STREAM_FILE DB");
        r = file_read_all(argv[0], FILE_MAX, &stream, &len);
        if (r < 0)
                return fail(r, "failed to read %s", argv[0]);
        /* Validate before creating anything, so that a bad stream leaves no database behind. */
        r = keyring_stream_decode(stream, len, &chunk_size, &image_size, &records, &n_decoded);
        free(records);
        if (r < 0) {
                status = fail(r, "failed to import keyring stream %s", argv[0]);
                goto out;
        }
        if (access(argv[1], F_OK) == 0)
                r = keyring_open(argv[1], &k);
        else
                r = keyring_create(argv[1], chunk_size, image_size > KEYRING_IMAGE_SIZE_MAX ? 0 : image_size, &k);
        if (r < 0) {
                status = fail(r, "failed to open keyring %s", argv[1]);
                goto out;
        }
        r = keyring_import_stream(k, stream, len);
        if (r < 0) {
                status = fail(r, "failed to import keyring stream %s", argv[0]);
                goto out;
        }
        r = keyring_count(k, &n_records);
        if (r < 0) {
                status = fail(r, "failed to count records of %s", argv[1]);
                goto out;
        }
        printf("chunk_size=%" PRIu32 "\nimage_size=%" PRIu64 "\nrecords=%" PRIu64 "\n", keyring_chunk_size(k),
               keyring_image_size(k), n_records);
        status = 0;
out:
        keyring_free(k);
        free(stream);
        return status;
}

static int cmd_keyring_export(int argc, char **argv) {
        uint8_t *stream = NULL, digest[KEYRING_DIGEST_LEN];
        size_t len = 0;
        Keyring *k = NULL;
        int r, status = 1;

        if (argc != 2)
                return usage_error("keyring-export takes DB OUT");
        r = keyring_open(argv[0], &k);
        if (r < 0)
                return fail(r, "failed to open keyring %s", argv[0]);
        r = keyring_export_stream(k, &stream, &len);
        if (r < 0) {
                status = fail(r, "failed to export keyring %s", argv[0]);
                goto out;
        }
        r = file_write_atomic(argv[1], stream, len, 0644);
        if (r < 0) {
                status = fail(r, "failed to write %s", argv[1]);
                goto out;
        }
        r = crypto_sha256(stream, len, digest);
        if (r < 0) {
                status = fail(r, "failed to hash keyring stream");
                goto out;
        }
        print_hex("digest", digest, sizeof(digest));
        printf("size=%zu\n", len);
        status = 0;
out:
        free(stream);
        keyring_free(k);
        return status;
}

static int cmd_keyring_digest(int argc, char **argv) {
        uint8_t digest[KEYRING_DIGEST_LEN];
        uint64_t size = 0;
        Keyring *k = NULL;
        int r;

        if (argc != 1)
                return usage_error("keyring-digest takes DB");
        r = keyring_open(argv[0], &k);
        if (r < 0)
                return fail(r, "failed to open keyring %s", argv[0]);
        r = keyring_digest(k, digest, &size);
        keyring_free(k);
        if (r < 0)
                return fail(r, "failed to compute digest of keyring %s", argv[0]);
        print_hex("digest", digest, sizeof(digest));
        printf("size=%" PRIu64 "\n", size);
        return 0;
}

static int cmd_keyring_wrap(int argc, char **argv) {
        uint8_t pk[KEYRING_PARCEL_KEY_LEN], key[KEYRING_KEY_LEN], wkey[KEYRING_WKEY_LEN];
        int r;

        if (argc != 2)
                return usage_error("keyring-wrap takes PK_HEX KEY_HEX");
        if (!parse_hex_key(argv[0], pk, sizeof(pk)) || !parse_hex_key(argv[1], key, sizeof(key)))
                return usage_error("PK_HEX and KEY_HEX must be 64 hex digits");
        r = keyring_wrap_key(pk, key, wkey);
        if (r < 0)
                return fail(r, "failed to wrap chunk key");
        print_hex("wkey", wkey, sizeof(wkey));
        return 0;
}

static int cmd_keyring_unwrap(int argc, char **argv) {
        uint8_t pk[KEYRING_PARCEL_KEY_LEN], key[KEYRING_KEY_LEN], wkey[KEYRING_WKEY_LEN];
        int r;

        if (argc != 2)
                return usage_error("keyring-unwrap takes PK_HEX WKEY_HEX");
        if (!parse_hex_key(argv[0], pk, sizeof(pk)) || !parse_hex_key(argv[1], wkey, sizeof(wkey)))
                return usage_error("PK_HEX must be 64 hex digits and WKEY_HEX 80");
        r = keyring_unwrap_key(pk, wkey, key);
        if (r < 0)
                return fail(r, "failed to unwrap chunk key");
        print_hex("key", key, sizeof(key));
        return 0;
}

static int cmd_manifest_open(int argc, char **argv) {
        uint8_t pk[MANIFEST_PARCEL_KEY_LEN], *in = NULL;
        size_t in_len = 0, n_indices = 0;
        const uint64_t *indices = NULL;
        uint64_t version;
        ManifestBlob devstate;
        Manifest *m = NULL;
        int r;

        if (argc != 4)
                return usage_error("manifest-open takes PK_HEX UUID VERSION IN");
        if (!parse_hex_key(argv[0], pk, sizeof(pk)))
                return usage_error("PK_HEX must be 64 hex digits");
        if (!parse_u64(argv[2], &version) || version == 0)
                return usage_error("VERSION must be a positive integer");
        r = file_read_all(argv[3], MANIFEST_PAYLOAD_MAX + (1 << 20), &in, &in_len);
        if (r < 0)
                return fail(r, "failed to read %s", argv[3]);
        r = manifest_open(pk, in, in_len, argv[1], version, &m);
        free(in);
        if (r == -EINVAL)
                return usage_error("UUID must be a canonical UUID string");
        if (r < 0)
                return fail(r, "failed to open manifest %s", argv[3]);

        printf("format=1\nparcel=%s\nversion=%" PRIu64 "\nname=%s\nchunk_size=%" PRIu32 "\n", manifest_parcel(m),
               manifest_version(m), manifest_name(m), manifest_chunk_size(m));
        for (ManifestImageId id = 0; id < _MANIFEST_IMAGE_MAX; id++) {
                const ManifestImage *image = manifest_image(m, id);
                const char *name = manifest_image_name(id);
                char label[64];

                printf("%s_size=%" PRIu64 "\n", name, image->size);
                snprintf(label, sizeof(label), "%s_keyring_sha256", name);
                print_hex(label, image->keyring_sha256, sizeof(image->keyring_sha256));
                printf("%s_keyring_size=%" PRIu64 "\n%s_chunks=%" PRIu64 "\n%s_chunk_size=%" PRIu32 "\n", name,
                       image->keyring_size, name, image->chunks, name, image->chunk_size);
                manifest_working_set(m, id, &indices, &n_indices);
                printf("%s_working_set=", name);
                for (size_t i = 0; i < n_indices; i++)
                        printf("%s%" PRIu64, i ? "," : "", indices[i]);
                putchar('\n');
        }
        printf("machine=%s\nsmp=%" PRIu64 "\nqemu_version=%s\nram_mib=%" PRIu64 "\nsuspended=%s\n", manifest_machine(m),
               manifest_smp(m), manifest_qemu_version(m) ? manifest_qemu_version(m) : "", manifest_ram_mib(m),
               manifest_suspended(m) ? "true" : "false");
        if (manifest_blob(m, "devstate", &devstate) == 0) {
                print_hex("devstate_sha256", devstate.sha256, sizeof(devstate.sha256));
                printf("devstate_size=%" PRIu64 "\n", devstate.size);
        }
        manifest_free(m);
        return 0;
}

static int cmd_pack_parse(int argc, char **argv) {
        uint64_t image_size, bytes = 0, parts = 0;
        uint8_t *data = NULL;
        PackInfo info;
        size_t len;
        char *end;
        int r;

        if (argc != 2)
                return usage_error("pack-parse takes IMAGE_SIZE IN");
        image_size = strtoull(argv[0], &end, 10);
        if (!*argv[0] || *end)
                return usage_error("IMAGE_SIZE must be a decimal integer");
        r = file_read_all(argv[1], FILE_MAX, &data, &len);
        if (r < 0)
                return fail(r, "failed to read %s", argv[1]);
        r = pack_parse(data, len, image_size, &info);
        if (r < 0) {
                free(data);
                return fail(r, "not a resume pack for an image of %" PRIu64 " bytes", image_size);
        }
        for (size_t i = 0; i < info.n; i++)
                bytes += info.extents[i].len;
        for (size_t i = 0; i < info.n_map; i++)
                parts = info.map[i].part > parts ? info.map[i].part : parts;
        printf("extents=%zu\nbytes=%" PRIu64 "\nmap=%zu\nmap_parts=%" PRIu64 "\nparts_max=%d\n", info.n, bytes,
               info.n_map, parts, PACK_PARTS_MAX);
        pack_info_free(&info);
        free(data);
        return 0;
}

static const struct {
        const char *name;
        int (*run)(int argc, char **argv);
        bool wants_options;     /* gets its own name as argv[0], for getopt */
} commands[] = {
        { "chunk-encode", cmd_chunk_encode, false },
        { "chunk-decode", cmd_chunk_decode, false },
        { "seal", cmd_seal, false },
        { "open", cmd_open, false },
        { "envelope-wrap", cmd_envelope_wrap, true },
        { "envelope-unwrap", cmd_envelope_unwrap, true },
        { "keyring-import", cmd_keyring_import, false },
        { "keyring-export", cmd_keyring_export, false },
        { "keyring-digest", cmd_keyring_digest, false },
        { "keyring-wrap", cmd_keyring_wrap, false },
        { "keyring-unwrap", cmd_keyring_unwrap, false },
        { "manifest-open", cmd_manifest_open, false },
        { "pack-parse", cmd_pack_parse, false },
};

int main(int argc, char **argv) {
        const char *debug = getenv("VULPES_CODEC_DEBUG");

        log_set_ident("vulpes-codec");
        /* The command prints the one line that matters; library details only on request. */
        log_set_max_level(debug && *debug && strcmp(debug, "0") != 0 ? LOG_DEBUG : LOG_CRIT);

        if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
                fputs(usage_text, argc < 2 ? stderr : stdout);
                return argc < 2 ? 2 : 0;
        }
        for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
                if (strcmp(argv[1], commands[i].name) == 0)
                        return commands[i].wants_options ? commands[i].run(argc - 1, argv + 1)
                                                         : commands[i].run(argc - 2, argv + 2);
        return usage_error("unknown command");
}

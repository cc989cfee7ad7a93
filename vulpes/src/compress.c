/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * zstd compression for chunk bodies and sealed blobs, and the only file that includes zstd.
 * Decompression is bounded: output never exceeds the length the caller expects, and any frame that does
 * not produce exactly that length is rejected.
 *
 * Threading: safe from any thread.  Each thread keeps one compression and one decompression context
 * for its lifetime: creating a zstd context per chunk costs more than decompressing the chunk.
 */
#include "compress.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <zstd.h>
#include <zstd_errors.h>

#include "log.h"

/* The magic number that opens an ordinary (not skippable) zstd frame, little-endian. */
static const uint8_t zstd_frame_magic[4] = { 0x28, 0xb5, 0x2f, 0xfd };

static pthread_once_t context_once = PTHREAD_ONCE_INIT;
static pthread_key_t cctx_key, dctx_key;

static void cctx_destroy(void *p) {
        ZSTD_freeCCtx(p);
}

static void dctx_destroy(void *p) {
        ZSTD_freeDCtx(p);
}

static void context_keys_create(void) {
        /* Failure leaves the keys invalid; pthread_getspecific() then yields NULL and we fall back to
         * a context per call. */
        if (pthread_key_create(&cctx_key, cctx_destroy) != 0 || pthread_key_create(&dctx_key, dctx_destroy) != 0)
                return;
}

/* This thread's compression context, reset; NULL if out of memory. *ret_owned: the caller frees it. */
static ZSTD_CCtx *cctx_get(bool *ret_owned) {
        ZSTD_CCtx *cctx;

        pthread_once(&context_once, context_keys_create);
        cctx = pthread_getspecific(cctx_key);
        *ret_owned = false;
        if (cctx) {
                ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
                return cctx;
        }
        cctx = ZSTD_createCCtx();
        if (cctx && pthread_setspecific(cctx_key, cctx) != 0)
                *ret_owned = true;
        return cctx;
}

static ZSTD_DCtx *dctx_get(bool *ret_owned) {
        ZSTD_DCtx *dctx;

        pthread_once(&context_once, context_keys_create);
        dctx = pthread_getspecific(dctx_key);
        *ret_owned = false;
        if (dctx) {
                ZSTD_DCtx_reset(dctx, ZSTD_reset_session_and_parameters);
                return dctx;
        }
        dctx = ZSTD_createDCtx();
        if (dctx && pthread_setspecific(dctx_key, dctx) != 0)
                *ret_owned = true;
        return dctx;
}

size_t compress_bound(size_t len) {
        return ZSTD_compressBound(len);
}

int compress_frame(const void *in, size_t len, int level, void *ret_out, size_t out_capacity, size_t *ret_len) {
        ZSTD_CCtx *cctx;
        bool owned;
        size_t n;
        int r = 0;

        cctx = cctx_get(&owned);
        if (!cctx)
                return -ENOMEM;
        if (ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level)) ||
            ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1)) ||
            ZSTD_isError(ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 0))) {
                log_error("failed to configure zstd compression: level %d rejected", level);
                r = -EINVAL;
                goto out_cctx;
        }
        n = ZSTD_compress2(cctx, ret_out, out_capacity, in, len);
        if (ZSTD_isError(n)) {
                if (ZSTD_getErrorCode(n) == ZSTD_error_dstSize_tooSmall) {
                        r = -ENOBUFS;
                } else {
                        log_error("failed to compress buffer: %s", ZSTD_getErrorName(n));
                        r = -EIO;
                }
                goto out_cctx;
        }
        *ret_len = n;
out_cctx:
        if (owned)
                ZSTD_freeCCtx(cctx);
        return r;
}

int compress_decompress_exact(const void *in, size_t len, void *ret_out, size_t expected_len) {
        uint8_t scratch;
        unsigned long long content_size;
        ZSTD_DCtx *dctx;
        bool owned;
        size_t frame_len, n;
        int r = 0;

        if (len < sizeof(zstd_frame_magic) || memcmp(in, zstd_frame_magic, sizeof(zstd_frame_magic)) != 0) {
                log_debug("failed to decompress zstd frame: bad magic");
                return -EBADMSG;
        }
        frame_len = ZSTD_findFrameCompressedSize(in, len);
        if (ZSTD_isError(frame_len) || frame_len != len) {
                log_debug("failed to decompress zstd frame: %s", ZSTD_isError(frame_len) ? "incomplete" : "trailing data");
                return -EBADMSG;
        }
        content_size = ZSTD_getFrameContentSize(in, len);
        if (content_size == ZSTD_CONTENTSIZE_ERROR ||
            (content_size != ZSTD_CONTENTSIZE_UNKNOWN && content_size != expected_len)) {
                log_debug("failed to decompress zstd frame: declares %llu bytes, expected %zu", content_size, expected_len);
                return -EBADMSG;
        }

        dctx = dctx_get(&owned);
        if (!dctx)
                return -ENOMEM;
        /* Writing into a buffer of exactly expected_len makes zstd fail on a frame that produces more. */
        n = ZSTD_decompressDCtx(dctx, expected_len ? ret_out : &scratch, expected_len, in, len);
        if (ZSTD_isError(n) || n != expected_len) {
                log_debug("failed to decompress zstd frame: %s", ZSTD_isError(n) ? ZSTD_getErrorName(n) : "too short");
                if (expected_len)
                        memset(ret_out, 0, expected_len);
                r = -EBADMSG;
        }
        if (owned)
                ZSTD_freeDCtx(dctx);
        return r;
}

/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * zstd compression for chunk bodies and sealed blobs, and the only file that includes zstd.
 * Decompression is bounded: output never exceeds the length the caller expects, and any frame that does
 * not produce exactly that length is rejected.
 *
 * Threading: safe from any thread; each call uses its own zstd context.
 */
#include "compress.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include <zstd.h>
#include <zstd_errors.h>

#include "log.h"

/* The magic number that opens an ordinary (not skippable) zstd frame, little-endian. */
static const uint8_t zstd_frame_magic[4] = { 0x28, 0xb5, 0x2f, 0xfd };

size_t compress_bound(size_t len) {
        return ZSTD_compressBound(len);
}

int compress_frame(const void *in, size_t len, int level, void *ret_out, size_t out_capacity, size_t *ret_len) {
        ZSTD_CCtx *cctx;
        size_t n;
        int r = 0;

        cctx = ZSTD_createCCtx();
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
        ZSTD_freeCCtx(cctx);
        return r;
}

int compress_decompress_exact(const void *in, size_t len, void *ret_out, size_t expected_len) {
        uint8_t scratch;
        unsigned long long content_size;
        ZSTD_DCtx *dctx;
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

        dctx = ZSTD_createDCtx();
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
        ZSTD_freeDCtx(dctx);
        return r;
}

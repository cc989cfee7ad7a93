/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * The file system: three files at the mountpoint, `disk` and `memory` (the images, read-write) and
 * `stats` (the status report, read-only).  The only file that includes libfuse.
 *
 * It uses libfuse's low-level API: the tree is fixed (root, three files with fixed inode numbers), so the
 * high-level API's path bookkeeping buys nothing, and the low-level API lets a read be answered straight
 * from the RAM cache: image_read_pin() hands out pinned pointers into the chunks, fuse_reply_iov() writes
 * them to the kernel, and the pins are dropped once that returns.  The kernel's copy into its page cache
 * is then the only copy of the plaintext on the read path.
 *
 * The images use the page cache (no direct_io), so QEMU can map `memory` MAP_SHARED and the kernel
 * writes dirty pages back as ordinary FUSE writes; keep_cache keeps pages across opens, since nobody
 * but this daemon changes the images.  fsync, and flush (on close) of a descriptor opened for writing,
 * make everything acknowledged before them durable (image_flush()).  `stats` is direct_io: each open
 * takes a fresh snapshot.
 *
 * Threading: libfuse's multithreaded loop calls these operations concurrently; image.c does the locking.
 */
#define FUSE_USE_VERSION 314
#define _GNU_SOURCE
#include "mount.h"

#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "log.h"
#include "warm.h"

enum {
        FILE_DISK = DAEMON_IMAGE_DISK,
        FILE_MEMORY = DAEMON_IMAGE_MEMORY,
        FILE_STATS,
        _FILE_MAX,
};

/* Inode numbers: the root is FUSE_ROOT_ID (1), file i is FIRST_FILE_INO + i. */
#define FIRST_FILE_INO 2
/* Sizes and names never change behind the kernel's back. */
#define TIMEOUT 3600.0
/* In fi->fh of an image: the descriptor may write, so its close flushes. */
#define FH_WRITABLE ((uint64_t) 1 << 8)
/* Pieces of a read that fit on the stack: a 1 MiB read of 128 KiB chunks needs at most 10. */
#define READ_IOV_STACK 32

static const char *const file_names[_FILE_MAX] = { "disk", "memory", "stats" };

struct Mount {
        Daemon *daemon;
        struct fuse_session *session;
        struct fuse_args args;
        char *mountpoint;
        bool mounted, signals;
        unsigned max_threads;
        unsigned kernel_readahead_kib;
        Warmer *warmer;
};

typedef struct StatsSnapshot {
        char *text;
        size_t len;
} StatsSnapshot;

static Daemon *daemon_of(fuse_req_t req) {
        return ((Mount *) fuse_req_userdata(req))->daemon;
}

/* The file behind an inode, or -ENOENT (also for the root). */
static int file_of(fuse_ino_t ino) {
        if (ino < FIRST_FILE_INO || ino >= FIRST_FILE_INO + _FILE_MAX)
                return -ENOENT;
        return (int) (ino - FIRST_FILE_INO);
}

static Image *image_of(fuse_req_t req, int file) {
        return daemon_image(daemon_of(req), (DaemonImage) file);
}

static int attr_fill(fuse_req_t req, fuse_ino_t ino, struct stat *st) {
        int file;

        memset(st, 0, sizeof(*st));
        st->st_ino = ino;
        st->st_uid = getuid();
        st->st_gid = getgid();
        st->st_nlink = 1;
        if (ino == FUSE_ROOT_ID) {
                st->st_mode = S_IFDIR | 0755;
                st->st_nlink = 2;
                return 0;
        }
        file = file_of(ino);
        if (file < 0)
                return file;
        if (file == FILE_STATS) {
                st->st_mode = S_IFREG | 0444;
                return 0;
        }
        st->st_mode = S_IFREG | 0600;
        st->st_size = (off_t) image_size(image_of(req, file));
        st->st_blocks = (st->st_size + 511) / 512;
        st->st_blksize = (blksize_t) image_chunk_size(image_of(req, file));
        return 0;
}

static void op_init(void *userdata, struct fuse_conn_info *conn) {
        Mount *m = userdata;

        /* The kernel's readahead is also the read-around of a page fault on the mapped memory image: at its
         * default of 128 KiB, centred on the faulting page, it nearly always spans two chunks, so every fault
         * of a resumed guest's RAM fetched two chunks.  32 KiB spans two a quarter of the time and still
         * brings in eight pages per fault from a warm cache (0 cost a warm workload a fifth more FUSE round
         * trips); vulpes reads ahead itself (image.c) where a sequential reader gains by it. */
        conn->max_readahead = m->kernel_readahead_kib << 10;
        /* Many background requests: each chunk that is not in RAM costs a cache file open and read (or a
         * server round trip), so sequential reads need many chunks in flight. */
        conn->max_write = 1 << 20;
        conn->max_background = 64;
        conn->congestion_threshold = 48;
        if (conn->capable & FUSE_CAP_ASYNC_DIO)
                conn->want |= FUSE_CAP_ASYNC_DIO;
        if (conn->capable & FUSE_CAP_PARALLEL_DIROPS)
                conn->want |= FUSE_CAP_PARALLEL_DIROPS;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
        struct fuse_entry_param e = { .attr_timeout = TIMEOUT, .entry_timeout = TIMEOUT };

        if (parent != FUSE_ROOT_ID) {
                fuse_reply_err(req, ENOTDIR);
                return;
        }
        for (int i = 0; i < _FILE_MAX; i++)
                if (strcmp(name, file_names[i]) == 0) {
                        e.ino = FIRST_FILE_INO + (fuse_ino_t) i;
                        e.generation = 1;
                        attr_fill(req, e.ino, &e.attr);
                        break;
                }
        /* Not found: an entry with inode 0 is a negative entry, cached as long as the others. */
        fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
        struct stat st;
        int r;

        (void) fi;
        r = attr_fill(req, ino, &st);
        if (r < 0)
                fuse_reply_err(req, -r);
        else
                fuse_reply_attr(req, &st, TIMEOUT);
}

static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set, struct fuse_file_info *fi) {
        int file = file_of(ino), r = 0;
        struct stat st;

        (void) fi;
        /* Only a size that is already the image's size is accepted; modes, owners and times are not kept. */
        if (to_set & (FUSE_SET_ATTR_MODE | FUSE_SET_ATTR_UID | FUSE_SET_ATTR_GID))
                r = -ENOSYS;
        else if ((to_set & FUSE_SET_ATTR_SIZE) &&
                 (file < 0 || file == FILE_STATS || (uint64_t) attr->st_size != image_size(image_of(req, file))))
                r = -EPERM;
        else if (to_set & (FUSE_SET_ATTR_ATIME | FUSE_SET_ATTR_MTIME | FUSE_SET_ATTR_ATIME_NOW |
                           FUSE_SET_ATTR_MTIME_NOW))
                r = -ENOSYS;
        if (r >= 0)
                r = attr_fill(req, ino, &st);
        if (r < 0)
                fuse_reply_err(req, -r);
        else
                fuse_reply_attr(req, &st, TIMEOUT);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset, struct fuse_file_info *fi) {
        static const char *const dots[] = { ".", ".." };
        char buf[512];
        size_t len = 0;
        off_t next = 0;

        (void) fi;
        if (ino != FUSE_ROOT_ID) {
                fuse_reply_err(req, ENOTDIR);
                return;
        }
        if (size > sizeof(buf))
                size = sizeof(buf);
        /* Entry k (0-based) carries offset k + 1, the offset to continue after it. */
        for (int k = (int) offset; k < 2 + _FILE_MAX; k++) {
                struct stat st = { .st_mode = k < 2 ? S_IFDIR : S_IFREG };
                const char *name = k < 2 ? dots[k] : file_names[k - 2];
                size_t n;

                st.st_ino = k < 2 ? FUSE_ROOT_ID : FIRST_FILE_INO + (fuse_ino_t) (k - 2);
                next = k + 1;
                n = fuse_add_direntry(req, buf + len, size - len, name, &st, next);
                if (n > size - len)
                        break;
                len += n;
        }
        fuse_reply_buf(req, buf, len);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
        int file = file_of(ino), r;
        StatsSnapshot *snap;

        if (ino == FUSE_ROOT_ID) {
                fuse_reply_err(req, EISDIR);
                return;
        }
        if (file < 0) {
                fuse_reply_err(req, -file);
                return;
        }
        if (file != FILE_STATS) {
                if (fi->flags & O_TRUNC) {
                        fuse_reply_err(req, EPERM);
                        return;
                }
                fi->keep_cache = 1;
                fi->fh = (uint64_t) file | ((fi->flags & O_ACCMODE) != O_RDONLY ? FH_WRITABLE : 0);
                /* The kernel's close of a file flushes it (writes the file's dirty pages back and waits): were
                 * vulpes killed with its warmer's descriptor open, its exit would wait on itself for ever, and
                 * its mounts and QEMU with it.  The warmer writes nothing: its close needs no flush. */
                if (warm_is_own(((Mount *) fuse_req_userdata(req))->warmer, fuse_req_ctx(req)->pid))
                        fi->noflush = 1;
                fuse_reply_open(req, fi);
                return;
        }
        if ((fi->flags & O_ACCMODE) != O_RDONLY) {
                fuse_reply_err(req, EACCES);
                return;
        }
        snap = calloc(1, sizeof(*snap));
        if (!snap) {
                fuse_reply_err(req, ENOMEM);
                return;
        }
        r = daemon_status_json(daemon_of(req), &snap->text, &snap->len);
        if (r < 0) {
                free(snap);
                fuse_reply_err(req, -r);
                return;
        }
        fi->direct_io = 1;
        fi->fh = (uint64_t) (uintptr_t) snap;
        if (fuse_reply_open(req, fi) == -ENOENT) {
                /* The opener is gone (interrupted): no release will come. */
                free(snap->text);
                free(snap);
        }
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
        if (file_of(ino) == FILE_STATS) {
                StatsSnapshot *snap = (StatsSnapshot *) (uintptr_t) fi->fh;

                free(snap->text);
                free(snap);
        }
        fuse_reply_err(req, 0);
}

static void read_stats(fuse_req_t req, size_t size, off_t offset, struct fuse_file_info *fi) {
        StatsSnapshot *snap = (StatsSnapshot *) (uintptr_t) fi->fh;
        char *copy;

        if (offset < 0 || (size_t) offset >= snap->len) {
                fuse_reply_buf(req, NULL, 0);
                return;
        }
        if (size > snap->len - (size_t) offset)
                size = snap->len - (size_t) offset;
        /* Replied from a copy: once the kernel has the reply, the reader may close the file and the release
         * free the snapshot on another thread while this one is still returning from the write. */
        copy = malloc(size);
        if (!copy) {
                fuse_reply_err(req, ENOMEM);
                return;
        }
        memcpy(copy, snap->text + offset, size);
        fuse_reply_buf(req, copy, size);
        free(copy);
}

/* A read the warmer asked the kernel for (warm.c): from what is here, untraced, never fetched. */
static void read_warm(fuse_req_t req, Image *img, size_t size, off_t offset, Warmer *w) {
        uint8_t *buf = malloc(size ? size : 1);
        ssize_t r;

        if (!buf) {
                fuse_reply_err(req, ENOMEM);
        } else {
                r = image_warm_read(img, buf, size, (uint64_t) offset);
                if (r < 0)
                        fuse_reply_err(req, (int) -r);
                else
                        fuse_reply_buf(req, (const char *) buf, (size_t) r);
                free(buf);
        }
        warm_served(w);
}

/* Replies with pointers into the RAM cache: the kernel copies them into its page cache, then they are unpinned. */
static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset, struct fuse_file_info *fi) {
        Mount *m = fuse_req_userdata(req);
        struct iovec stack_iov[READ_IOV_STACK], *iov = stack_iov;
        int file = file_of(ino);
        size_t max_iov, n = 0;
        Image *img;
        ssize_t r;

        if (file < 0 || offset < 0) {
                fuse_reply_err(req, file < 0 ? -file : EINVAL);
                return;
        }
        if (file == FILE_STATS) {
                read_stats(req, size, offset, fi);
                return;
        }
        img = image_of(req, file);
        if (warm_is_own(m->warmer, fuse_req_ctx(req)->pid)) {
                read_warm(req, img, size, offset, m->warmer);
                return;
        }
        max_iov = image_read_pieces_max(img, size);
        if (max_iov > READ_IOV_STACK) {
                iov = malloc(max_iov * sizeof(*iov));
                if (!iov) {
                        fuse_reply_err(req, ENOMEM);
                        return;
                }
        }
        r = image_read_pin(img, size, (uint64_t) offset, iov, max_iov, &n);
        if (r < 0)
                fuse_reply_err(req, (int) -r);
        else
                fuse_reply_iov(req, iov, (int) n);
        image_read_release(img, iov, n, (uint64_t) offset);
        if (iov != stack_iov)
                free(iov);
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t offset,
                     struct fuse_file_info *fi) {
        int file = file_of(ino);
        ssize_t r;

        (void) fi;
        if (file < 0 || file == FILE_STATS || offset < 0) {
                fuse_reply_err(req, file < 0 ? -file : file == FILE_STATS ? EACCES : EINVAL);
                return;
        }
        r = image_write(image_of(req, file), buf, size, (uint64_t) offset);
        if (r < 0)
                fuse_reply_err(req, (int) -r);
        else
                fuse_reply_write(req, (size_t) r);
}

static bool no_room(int r) {
        return r == -ENOSPC || r == -EDQUOT;
}

/*
 * image_flush() for fsync and close.  QEMU takes a failed flush of a file it uses through the page cache
 * as final: every later flush fails too, so a VM paused on it could never go on.  Writes reserve room in
 * the cache before they are acknowledged, so a flush of the disk finds none only if another process took
 * the space meanwhile: it waits for room (the writes that need some fail with ENOSPC meanwhile, which
 * pauses the VM).  A flush of the memory image (isrctl's fsync at a suspend) says ENOSPC.
 */
static int flush_file(fuse_req_t req, fuse_ino_t ino) {
        int file = file_of(ino), r;

        if (file < 0 || file == FILE_STATS)
                return file < 0 ? file : 0;
        r = image_flush(image_of(req, file));
        for (bool warned = false; file == FILE_DISK && no_room(r) && !fuse_req_interrupted(req); warned = true) {
                if (!warned)
                        log_warning("failed to flush the disk image: the cache has no room; waiting for room");
                sleep(1);
                r = image_flush(image_of(req, file));
        }
        if (no_room(r))
                return -ENOSPC;
        return r < 0 ? -EIO : 0;
}

static void op_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi) {
        (void) datasync;
        (void) fi;
        fuse_reply_err(req, -flush_file(req, ino));
}

static void op_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
        /* close(): cheap when nothing is dirty, and a closing QEMU expects its data to be safe.  A
         * read-only descriptor has nothing to make safe. */
        if (file_of(ino) == FILE_STATS || !(fi->fh & FH_WRITABLE)) {
                fuse_reply_err(req, 0);
                return;
        }
        fuse_reply_err(req, -flush_file(req, ino));
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino) {
        Daemon *d = daemon_of(req);
        struct statvfs st;
        uint64_t total = 0;

        (void) ino;
        for (int i = 0; i < _DAEMON_IMAGE_MAX; i++)
                total += image_size(daemon_image(d, (DaemonImage) i));
        memset(&st, 0, sizeof(st));
        st.f_bsize = 4096;
        st.f_frsize = 4096;
        st.f_blocks = total / 4096;
        st.f_files = _FILE_MAX;
        st.f_namemax = 255;
        fuse_reply_statfs(req, &st);
}

/*
 * fallocate: the images are fully allocated and never grow, so mode 0 within the image is a no-op.
 * PUNCH_HOLE (with KEEP_SIZE, as the kernel demands) and ZERO_RANGE make the range read as zeros
 * (image_punch()): QEMU punches the guest RAM pages the guest reports free (virtio-balloon's free page
 * reporting) and the disk blocks it discards.  The kernel writes back the range's dirty pages before and
 * drops them from its page cache after.
 */
static void op_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset, off_t length,
                         struct fuse_file_info *fi) {
        int file = file_of(ino), r = 0;
        bool zeroes = mode == (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE) || mode == FALLOC_FL_ZERO_RANGE ||
                      mode == (FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE);
        Image *img;

        (void) fi;
        if (file < 0) {
                fuse_reply_err(req, -file);
                return;
        }
        if (file == FILE_STATS || offset < 0 || length <= 0 || (mode != 0 && !zeroes)) {
                fuse_reply_err(req, file == FILE_STATS ? EACCES : mode != 0 && !zeroes ? EOPNOTSUPP : EINVAL);
                return;
        }
        img = image_of(req, file);
        /* Growing the image is not allowed; a hole that reaches past its end (KEEP_SIZE) is clipped. */
        if ((uint64_t) offset + (uint64_t) length > image_size(img) && !(mode & FALLOC_FL_KEEP_SIZE))
                r = -EOPNOTSUPP;
        else if (zeroes)
                r = image_punch(img, (uint64_t) offset, (uint64_t) length);
        fuse_reply_err(req, no_room(r) ? ENOSPC : -r);
}

static const struct fuse_lowlevel_ops operations = {
        .init = op_init,
        .lookup = op_lookup,
        .getattr = op_getattr,
        .setattr = op_setattr,
        .readdir = op_readdir,
        .open = op_open,
        .release = op_release,
        .read = op_read,
        .write = op_write,
        .fsync = op_fsync,
        .flush = op_flush,
        .statfs = op_statfs,
        .fallocate = op_fallocate,
};

int mount_new(Daemon *d, const FuseOptions *options, Mount **ret) {
        Mount *m;
        int r;

        m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        m->daemon = d;
        m->max_threads = options->max_threads ? options->max_threads : 64;
        m->kernel_readahead_kib = options->kernel_readahead_kib;
        m->mountpoint = strdup(options->mountpoint);
        if (!m->mountpoint) {
                r = -ENOMEM;
                goto out_free;
        }
        for (int i = 0; i < options->argc; i++)
                if (fuse_opt_add_arg(&m->args, options->argv[i]) < 0) {
                        r = -ENOMEM;
                        goto out_free;
                }
        m->session = fuse_session_new(&m->args, &operations, sizeof(operations), m);
        if (!m->session) {
                log_error("failed to set up the file system (bad FUSE options?)");
                r = -EINVAL;
                goto out_free;
        }
        if (options->signals) {
                if (fuse_set_signal_handlers(m->session) != 0) {
                        r = -EIO;
                        goto out_free;
                }
                m->signals = true;
        }
        if (fuse_session_mount(m->session, m->mountpoint) != 0) {
                log_error("failed to mount on %s", m->mountpoint);
                r = -EIO;
                goto out_free;
        }
        m->mounted = true;
        *ret = m;
        return 0;

out_free:
        mount_free(m);
        return r;
}

int mount_run(Mount *m) {
        struct fuse_loop_config *config;
        int r;

        config = fuse_loop_cfg_create();
        if (!config)
                return -ENOMEM;
        /* Idle threads are kept (libfuse's default): reaping them costs a thread creation per burst of
         * readahead requests. */
        fuse_loop_cfg_set_max_threads(config, m->max_threads);
        r = fuse_session_loop_mt(m->session, config);
        fuse_loop_cfg_destroy(config);
        return r == 0 ? 0 : -EIO;
}

void mount_set_warmer(Mount *m, Warmer *w) {
        m->warmer = w;
}

int mount_invalidate(void *mount, DaemonImage id) {
        Mount *m = mount;
        int r;

        if (!m->mounted)
                return 0;
        /* Offset 0, length 0: every cached page of the file; mappings (QEMU's guest RAM) are unmapped too. */
        r = fuse_lowlevel_notify_inval_inode(m->session, FIRST_FILE_INO + (fuse_ino_t) id, 0, 0);
        return r == -ENOENT ? 0 : r;            /* the kernel has never looked the file up on this mount */
}

void mount_stop(Mount *m) {
        fuse_session_exit(m->session);
        if (m->mounted) {
                fuse_session_unmount(m->session);
                m->mounted = false;
        }
}

Mount *mount_free(Mount *m) {
        if (!m)
                return NULL;
        if (m->session) {
                if (m->signals)
                        fuse_remove_signal_handlers(m->session);
                if (m->mounted)
                        fuse_session_unmount(m->session);
                fuse_session_destroy(m->session);
        }
        fuse_opt_free_args(&m->args);
        free(m->mountpoint);
        free(m);
        return NULL;
}

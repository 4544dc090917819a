/* fileio.h: opening the files ./run reads (the checkpoint, --ppl, --prompts); output.c
 * shares its file kinds and its non-blocking open.
 *
 * Only regular files are read: a FIFO blocks the open until a writer comes, a device can
 * stream without end, so each is refused at once with one sentence. The open itself never
 * blocks (O_NONBLOCK until fstat has shown a regular file). */
#ifndef FILEIO_H
#define FILEIO_H

#include <stddef.h>
#include <sys/types.h>

/* A descriptor of path for ordinary (blocking) reads and *size its length, when path is a
 * regular file; else -1 and one sentence in err that names it as `what` followed by the
 * path (what is "checkpoint " or ""). */
int open_regular(const char *path, const char *what, size_t *size, char *err, size_t errlen);

/* What a file of this mode is, for messages: "directory", "FIFO", "socket", ... */
const char *file_kind(mode_t mode);

/* Back to blocking I/O on fd, opened with O_NONBLOCK so that the open itself cannot hang.
 * Returns 0, or -1 with errno set. */
int clear_nonblock(int fd);

/* Reads n bytes at offset off into buf. Returns 0, or -1 with errno set: 0 when the file
 * ended first (it shrank since its size was taken). */
int read_at(int fd, void *buf, size_t n, size_t off);

#endif /* FILEIO_H */

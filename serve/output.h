/* output.h: opening the files ./run writes (--log, --dump-logits) so that a run never
 * hangs on one and never overwrites one of its own inputs. */
#ifndef OUTPUT_H
#define OUTPUT_H

#include <stddef.h>
#include <stdio.h>

typedef struct {
    const char *what; /* for messages: "the checkpoint", "the --log file", ... */
    const char *path; /* NULL: none given */
} NamedPath;

/* Opens path for writing, truncated, into *out. Refused, with one sentence in err: a
 * regular file that is one of inputs[0..n_inputs) under any name (the same device and
 * inode: a symlink or hard link too) or the file standard output or standard error writes,
 * a directory, a socket or a block device (return 2, a misuse); a path
 * that cannot be opened, and a FIFO no process reads, which would block the open forever
 * (return 1). A FIFO with a reader and character devices (/dev/null) are written like
 * files. Returns 0 on success. */
int output_open(FILE **out, const char *path, const NamedPath *inputs, int n_inputs, char *err, size_t errlen);

#endif /* OUTPUT_H */

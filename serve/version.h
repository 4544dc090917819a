/* version.h: what ./run --version prints, and the JSON outputs carry. */
#ifndef VERSION_H
#define VERSION_H

#define RUN_VERSION "0.1.0"

/* The git commit the program was built from (short hash, "-dirty" when tracked files
 * had changes), or "unknown" outside a git checkout. */
const char *build_commit(void);

#endif /* VERSION_H */

/* version.c: the build's commit (version.h), passed in by the Makefile. */
#include "serve/version.h"

#ifndef GIT_COMMIT
#define GIT_COMMIT "unknown"
#endif

const char *build_commit(void) { return GIT_COMMIT; }

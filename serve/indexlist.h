/* indexlist.h: a list of indices as the command line writes it ("all", or "0,3,5-7"), for
 * choosing what --dump-attn records. */
#ifndef INDEXLIST_H
#define INDEXLIST_H

#include <stddef.h>

enum { INDEX_LIST_MAX_RANGES = 32 };

typedef struct {
    int all; /* "all" (or the list not given) */
    int n;
    int lo[INDEX_LIST_MAX_RANGES], hi[INDEX_LIST_MAX_RANGES]; /* ranges lo..hi, both included */
} IndexList;

/* Parses s into l: "all", or up to INDEX_LIST_MAX_RANGES items "N" or "A-B" (0 <= A <= B)
 * separated by commas. Returns 0, or 2 with one sentence in err naming flag. */
int index_list_parse(IndexList *l, const char *s, const char *flag, char *err, size_t errlen);
/* 1 when i is in the list. */
int index_list_has(const IndexList *l, int i);
/* The largest index listed (-1 for "all"). */
int index_list_max(const IndexList *l);

#endif /* INDEXLIST_H */

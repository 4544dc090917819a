/* textfile.h: reads text in the TinyStoriesV2 layout: stories separated by lines
 * that hold only <|endoftext|>. Each story is stripped of surrounding white space;
 * empty stories are dropped (as train/prepare.py does). */
#ifndef TEXTFILE_H
#define TEXTFILE_H

#include <stddef.h>

typedef struct {
    char *text;          /* the file, split in place */
    char **stories;      /* NUL-terminated, valid UTF-8 without NUL bytes */
    int n_stories;
} StoryFile;

/* From a file; on failure -1 and one sentence in err (missing file, no story,
 * invalid UTF-8 or a NUL byte, with the story's number). */
int storyfile_read(StoryFile *f, const char *path, char *err, size_t errlen);
/* From memory (copied); the same checks. */
int storyfile_parse(StoryFile *f, const char *data, size_t size, char *err, size_t errlen);
void storyfile_free(StoryFile *f);

#endif /* TEXTFILE_H */
